#!/usr/bin/env bash
# A private Docker daemon that leaves the host's networking alone.
#
#   deploy/docker/dockerd.sh start DIR   start dockerd with its state under DIR, wait until it
#                                        answers, print the DOCKER_HOST to use
#   deploy/docker/dockerd.sh stop DIR    SIGTERM it, wait for it to exit, unmount what it left
#   deploy/docker/dockerd.sh status DIR  exit 0 when a daemon answers on DIR/docker.sock
#
# The daemon runs with --iptables=false --ip-forward=false --bridge=none and its own data root,
# exec root, socket and pid file under DIR (needs root and the `dockerd` binary, Debian's
# docker.io). Containers then have no bridge network: build and run with --network host.
# Keep DIR between runs (DIR/data holds the images) to reuse the base image and the build cache.
# DIR must be short (the daemon's sockets live under it; a Unix socket path has ~100 bytes).
set -euo pipefail

usage() { echo "usage: $0 start|stop|status DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
cmd=$1
dir=$(realpath -m "$2")
sock="$dir/docker.sock"
pidfile="$dir/docker.pid"
log="$dir/dockerd.log"
export DOCKER_HOST="unix://$sock"

answers() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }
running_pid() {
  local pid
  [ -f "$pidfile" ] || return 1
  pid=$(cat "$pidfile" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}
unmount_left() {
  # The daemon bind-mounts a netns file at DIR/exec/netns/default, and a container's layers
  # under DIR; both stay mounted when the daemon dies hard. Deepest first.
  local m
  awk -v d="$dir/" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r | while read -r m; do
    echo "dockerd.sh: umount $m"
    umount "$m" || umount -l "$m"
  done
}

case "$cmd" in
  start)
    if pid=$(running_pid); then
      if answers; then
        echo "dockerd.sh: a daemon already answers on $sock (pid $pid)"
        echo "export DOCKER_HOST=$DOCKER_HOST"
        exit 0
      fi
      echo "dockerd.sh: dockerd (pid $pid) runs for $dir but does not answer; stop it first" >&2
      exit 1
    fi
    [ "$(id -u)" = 0 ] || { echo "dockerd.sh: needs root to start dockerd" >&2; exit 1; }
    command -v dockerd >/dev/null || {
      echo "dockerd.sh: no dockerd binary (apt-get install docker.io)" >&2; exit 1; }
    command -v docker >/dev/null || {
      echo "dockerd.sh: no docker client (apt-get install docker.io)" >&2; exit 1; }
    if [ ${#sock} -gt 90 ]; then
      echo "dockerd.sh: DIR is too long for the daemon's sockets: $dir" >&2; exit 1
    fi
    mkdir -p "$dir/data" "$dir/exec"
    [ -f "$dir/daemon.json" ] || echo '{}' > "$dir/daemon.json"
    unmount_left
    rm -f "$pidfile" "$sock"
    echo "dockerd.sh: starting dockerd (state in $dir, log $log)"
    # No bridge, no iptables rules, no IP forwarding: the host's network stays as it is.
    setsid dockerd --iptables=false --ip-forward=false --bridge=none \
      --config-file "$dir/daemon.json" --data-root "$dir/data" --exec-root "$dir/exec" \
      --host "unix://$sock" --pidfile "$pidfile" >"$log" 2>&1 </dev/null &
    pid=$!
    for _ in $(seq 1 120); do
      if answers; then
        echo "dockerd.sh: dockerd $(docker version --format '{{.Server.Version}}') ready (pid $pid)"
        echo "export DOCKER_HOST=$DOCKER_HOST"
        exit 0
      fi
      if ! kill -0 "$pid" 2>/dev/null; then
        echo "dockerd.sh: dockerd exited before it answered; its log ends:" >&2
        tail -n 20 "$log" >&2
        unmount_left
        exit 1
      fi
      sleep 0.5
    done
    echo "dockerd.sh: dockerd did not answer within 60 s; stopping it; its log ends:" >&2
    tail -n 20 "$log" >&2
    kill -TERM "$pid" 2>/dev/null || true
    exit 1
    ;;
  stop)
    if pid=$(running_pid); then
      echo "dockerd.sh: stopping dockerd (pid $pid)"
      kill -TERM "$pid"
      for _ in $(seq 1 60); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
      done
      if kill -0 "$pid" 2>/dev/null; then
        echo "dockerd.sh: dockerd still running after 30 s; SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
        sleep 1
      fi
    else
      echo "dockerd.sh: no daemon running for $dir"
    fi
    unmount_left
    rm -f "$pidfile"
    ;;
  status)
    if answers; then echo "dockerd.sh: answering on $sock"; else
      echo "dockerd.sh: no daemon answers on $sock"; exit 1; fi
    ;;
  *) usage ;;
esac
