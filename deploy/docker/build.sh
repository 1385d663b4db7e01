#!/usr/bin/env bash
# Build the pdserve image without any image registry: the base image is made from Debian's
# package repositories (mmdebstrap, then `docker import`), pip reaches the package index through
# the host's network. Needs a reachable Docker daemon (DOCKER_HOST; deploy/docker/dockerd.sh
# starts a private one) and, to make the base once, root and mmdebstrap.
#
# usage: deploy/docker/build.sh [options]
#   --variant cpu|cuda    torch build in the image (default cpu); cuda tags <version>-cuda
#   --tag NAME:TAG        image tag (default pdserve:<version from pyproject.toml>[-cuda]);
#                         a "latest" tag is refused
#   --base-suite SUITE    Debian suite of the base (default bookworm: Python 3.11, matching
#                         the cp311 torch wheel; trixie has 3.13)
#   --mirror URL          Debian mirror for the base (default http://deb.debian.org/debian)
#   --ca-dir DIR          install DIR/*.crt into the base's trust store, for an HTTPS proxy
#                         that re-signs traffic (default /usr/local/share/ca-certificates when
#                         it holds any .crt); they stay trusted in the image
#   --no-ca               install no extra CA certificates
#   --wheels DIR          where to look for the CPU torch wheel (default: pip's find-links);
#                         without one the build downloads it from the PyTorch CPU index
#   --rebuild-base        make the base image again even if it exists
#   --with-ray            also install pdserve's `ray` extra (Ray for the KubeRay manifest in
#                         deploy/ray); tags <version>[-cuda]-ray
# The base is tagged pdserve-base:<suite>-<hash of its recipe and CA certificates> and reused
# while both stay the same.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

variant=cpu tag="" suite=bookworm mirror=http://deb.debian.org/debian ca_dir="" no_ca=0
wheels_dir="" rebuild_base=0 extras=""
die() { echo "build.sh: $*" >&2; exit 2; }
need_value() { if [ $# -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value"; fi; }
while [ $# -gt 0 ]; do
  case "$1" in
    --variant) need_value "$@"; variant=$2; shift 2 ;;
    --tag) need_value "$@"; tag=$2; shift 2 ;;
    --base-suite) need_value "$@"; suite=$2; shift 2 ;;
    --mirror) need_value "$@"; mirror=$2; shift 2 ;;
    --ca-dir) need_value "$@"; ca_dir=$2; shift 2 ;;
    --no-ca) no_ca=1; shift ;;
    --wheels) need_value "$@"; wheels_dir=$2; shift 2 ;;
    --rebuild-base) rebuild_base=1; shift ;;
    --with-ray) extras=ray; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

case "$variant" in cpu|cuda) ;; *) die "--variant: want cpu or cuda, got '$variant'" ;; esac
case "$suite" in *[!a-z0-9-]*|"") die "--base-suite: want a Debian suite name, got '$suite'" ;; esac
version=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$root/pyproject.toml" | head -n 1)
[ -n "$version" ] || die "no version in $root/pyproject.toml"
torch_version=$(sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' "$root/pyproject.toml" | head -n 1)
[ -n "$torch_version" ] || die "no pinned torch==X in $root/pyproject.toml"
if [ -z "$tag" ]; then
  tag="pdserve:$version"
  [ "$variant" = cpu ] || tag="$tag-$variant"
  [ -z "$extras" ] || tag="$tag-$extras"
fi
case "$tag" in
  *:latest) die "--tag: name a version, not latest ($tag)" ;;
  *:*) ;;
  *) die "--tag: want NAME:TAG with an explicit tag, got '$tag'" ;;
esac
if [ "$no_ca" = 1 ]; then
  ca_dir=""
elif [ -z "$ca_dir" ] && compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  ca_dir=/usr/local/share/ca-certificates
fi
if [ -n "$ca_dir" ]; then
  [ -d "$ca_dir" ] || die "--ca-dir: no such directory: $ca_dir"
  compgen -G "$ca_dir/*.crt" >/dev/null || die "--ca-dir: no .crt file in $ca_dir"
fi

run() { echo "+ $*"; "$@"; }
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

command -v docker >/dev/null || die "no docker client (apt-get install docker.io)"
if ! docker version --format '{{.Server.Version}}' >/dev/null 2>&1; then
  die "no Docker daemon answers (DOCKER_HOST=${DOCKER_HOST:-unset}); start a private one with
  deploy/docker/dockerd.sh start DIR   and export the DOCKER_HOST it prints"
fi
echo "build.sh: image $tag (variant $variant, pdserve $version, torch $torch_version)," \
     "daemon $(docker version --format '{{.Server.Version}}') at ${DOCKER_HOST:-the default socket}"

# --- the base image: Debian minbase + CA certificates, from the package repositories ---------
sources=("deb $mirror $suite main")
case "$suite" in
  sid|unstable|experimental) ;;  # no security or updates suites
  *) sources+=("deb ${mirror%/debian}/debian-security $suite-security main"
               "deb $mirror $suite-updates main") ;;
esac
# Leave docs, man pages and translations out of every package (the image's too).
dpkg_opts=(--dpkgopt='path-exclude=/usr/share/doc/*'
           --dpkgopt='path-include=/usr/share/doc/*/copyright'
           --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
           --dpkgopt='path-exclude=/usr/share/locale/*'
           --dpkgopt='path-include=/usr/share/locale/locale.alias')
recipe="minbase ca-certificates $suite ${sources[*]} ${dpkg_opts[*]}"
if [ -n "$ca_dir" ]; then
  base_hash=$( { echo "$recipe"; cat "$ca_dir"/*.crt; } | sha256sum | cut -c1-12)
else
  base_hash=$(echo "$recipe" | sha256sum | cut -c1-12)
fi
base="pdserve-base:$suite-$base_hash"
if [ "$rebuild_base" = 0 ] && docker image inspect "$base" >/dev/null 2>&1; then
  echo "build.sh: reusing base image $base"
else
  command -v mmdebstrap >/dev/null ||
    die "no mmdebstrap to make the base (apt-get install mmdebstrap)"
  echo "build.sh: making base image $base from $mirror ($suite)" \
       "${ca_dir:+with the CA certificates of $ca_dir}"
  t0=$(now)
  work=$(mktemp -d "${TMPDIR:-/var/tmp}/pdserve-base.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  hooks=()
  if [ -n "$ca_dir" ]; then
    mkdir "$work/ca" && cp "$ca_dir"/*.crt "$work/ca/"
    # shellcheck disable=SC2016  # $1 is mmdebstrap's: the chroot directory
    hooks=(--customize-hook="cp $work/ca/*.crt \"\$1/usr/local/share/ca-certificates/\""
           --customize-hook='chroot "$1" update-ca-certificates')
  fi
  # To a file first: a failed bootstrap must not leave a truncated image behind.
  run mmdebstrap --variant=minbase --include=ca-certificates "${dpkg_opts[@]}" "${hooks[@]}" \
    "$suite" "$work/base.tar" "${sources[@]}"
  run docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/sh"]' \
    --message "debian $suite minbase (mmdebstrap)${ca_dir:+ + CA certificates}" \
    "$work/base.tar" "$base"
  rm -rf "$work"
  trap - EXIT
  echo "build.sh: base image $base made in $(took "$t0") s"
fi

# --- the wheelhouse in the build context: the CPU torch wheel, found locally ----------------
wheelhouse="$here/wheels"
mkdir -p "$wheelhouse"
find "$wheelhouse" -mindepth 1 -maxdepth 1 -name '*.whl' -delete
echo "Local wheels for the image build (deploy/docker/build.sh fills this; not in git)." \
  > "$wheelhouse/README"
if [ "$variant" = cpu ]; then
  case "$suite" in bookworm) py=cp311 ;; trixie) py=cp313 ;; *) py="cp3*" ;; esac
  if [ -z "$wheels_dir" ]; then
    # pip's find-links (global, user, site or environment): space-separated paths or file: URLs.
    wheels_dir=$(python3 -m pip config list 2>/dev/null |
      sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sed 's#^file://##' |
      tr '\n' ' ')
    wheels_dir="$wheels_dir ${PIP_FIND_LINKS:-}"
  fi
  found=""
  for d in $wheels_dir; do
    # shellcheck disable=SC2231  # $py may be a glob (cp3*)
    for w in "$d"/torch-"$torch_version"+cpu-$py-*linux*x86_64.whl; do
      [ -f "$w" ] && { found=$w; break 2; }
    done
  done
  if [ -n "$found" ]; then
    echo "build.sh: using the local CPU torch wheel $found"
    ln -f "$found" "$wheelhouse/" 2>/dev/null || run cp "$found" "$wheelhouse/"
  else
    echo "build.sh: no local torch-$torch_version+cpu $py wheel" \
         "(looked in:${wheels_dir:- nothing});" \
         "the build downloads it from the PyTorch CPU index"
  fi
fi

# --- the image ------------------------------------------------------------------------------
revision=$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
changed=$(git -C "$root" status --porcelain -- pdserve pyproject.toml deploy/docker 2>/dev/null || true)
if [ "$revision" != unknown ] && [ -n "$changed" ]; then
  revision="$revision-dirty"
fi
t0=$(now)
# The classic builder: BuildKit needs the buildx plugin, which Debian's docker.io lacks.
DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0} run docker build --network host \
  -f "$here/Dockerfile" \
  --build-arg BASE_IMAGE="$base" --build-arg VARIANT="$variant" --build-arg EXTRAS="$extras" \
  --build-arg TORCH_VERSION="$torch_version" --build-arg VERSION="$version" \
  --build-arg REVISION="$revision" \
  -t "$tag" "$root"
size=$(docker image inspect --format '{{.Size}}' "$tag")
echo "build.sh: built $tag in $(took "$t0") s; $((size / 1000000)) MB"
