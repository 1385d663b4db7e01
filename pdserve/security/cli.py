"""The internal-TLS flags every cluster process takes, and `pdserve certs`.

Owns `--tls-dir DIR` / `--insecure-internal` / `--health-address` (one definition for the
master, storage nodes, workers, the router, the controller and the single-process store;
`PDSERVE_TLS_DIR` and `PDSERVE_INSECURE_INTERNAL=1` stand in for the first two), turning them
into this process's setting (a bad folder is a one-line error naming the flag, exit 2), and the
`pdserve certs` commands that make and renew a TLS folder (`init`, `issue`, `renew`, `show`).
Must not hold crypto (`pki.py`) or serve anything.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

from pdserve.core.identity import KINDS, Identity
from pdserve.security import pki, tls


def add_flags(parser: argparse.ArgumentParser, health: bool = True) -> None:
    g = parser.add_argument_group("internal TLS")
    g.add_argument("--tls-dir", default=None,
                   help="the cluster's TLS folder: ca.crt and this process's <kind>.crt/.key "
                        f"(default: ${tls.TLS_DIR_ENV}); `pdserve certs init DIR` makes one")
    g.add_argument("--insecure-internal", action="store_true",
                   help="internal calls in plaintext, unauthenticated: anyone who reaches a "
                        "port may call it (only on a network you trust)")
    if health:
        g.add_argument("--health-address", default=None,
                       help="also serve gRPC health alone, in plaintext, on this host:port (for "
                            "probes that speak no TLS, as Kubernetes' do)")


def configure(args: argparse.Namespace, kind: str,
              parser: argparse.ArgumentParser | None = None) -> tls.Security:
    """Set this process's internal TLS from its flags; a bad setting exits 2 naming the flag."""
    try:
        return tls.configure(tls.from_settings(kind, args.tls_dir, args.insecure_internal))
    except (tls.NotConfigured, pki.PkiError, ValueError) as e:
        message = f"--tls-dir: {e}" if isinstance(e, pki.PkiError) else str(e)
        if parser is not None:
            parser.error(message)
        print(f"pdserve: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def forward(security: tls.Security) -> list[str]:
    """The flags that give a child process this process's setting (its TLS folder)."""
    if security.insecure:
        return ["--insecure-internal"]
    return ["--tls-dir", security.folder.path]  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve certs",
                                description="Make and renew a pdserve cluster's TLS folder.")
    sub = p.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="a new CA and a certificate per component kind")
    init.add_argument("dir")
    init.add_argument("--cluster-id", default="pdserve", help="named in the CA's subject")
    init.add_argument("--lifetime-s", type=float, default=pki.LEAF_LIFETIME_S,
                      help="the certificates' lifetime (the CA's is a year)")
    issue = sub.add_parser("issue", help="a certificate for one identity, from a CA folder")
    issue.add_argument("dir", help="where to write <kind>.crt/.key and ca.crt")
    issue.add_argument("--kind", required=True, choices=KINDS)
    issue.add_argument("--name", required=True, help="the holder, e.g. a person or a pod")
    issue.add_argument("--ca-dir", default=None, help="the folder with ca.key (default: dir)")
    issue.add_argument("--lifetime-s", type=float, default=pki.LEAF_LIFETIME_S)
    renew = sub.add_parser("renew", help="re-issue the certificates past 2/3 of their life")
    renew.add_argument("dir")
    renew.add_argument("--force", action="store_true", help="re-issue every one now")
    renew.add_argument("--lifetime-s", type=float, default=pki.LEAF_LIFETIME_S)
    show = sub.add_parser("show", help="who each certificate names and until when")
    show.add_argument("dir")
    a = p.parse_args(argv)
    try:
        if a.command == "init":
            if os.path.exists(os.path.join(a.dir, pki.CA_KEY)):
                p.error(f"dir: {a.dir} already holds a CA ({pki.CA_KEY}); use renew or issue")
            pki.init_folder(a.dir, a.cluster_id, lifetime_s=a.lifetime_s)
            print(f"made a CA and certificates for {', '.join(KINDS)} in {a.dir}")
        elif a.command == "issue":
            try:
                identity = Identity(a.kind, a.name)
            except ValueError as e:
                p.error(f"--name: {e}")
            pki.issue_into(a.dir, identity, a.lifetime_s, a.ca_dir)
            print(f"issued {identity} into {a.dir}")
        elif a.command == "renew":
            done = pki.renew_folder(a.dir, a.lifetime_s, force=a.force)
            print(f"renewed: {', '.join(done) or 'none due'}")
        else:
            rows = []
            for kind in KINDS:
                path = os.path.join(a.dir, pki.cert_file(kind))
                if os.path.exists(path):
                    i = pki.info(pki.read(path))
                    rows.append({"file": pki.cert_file(kind), "identity": str(i.identity),
                                 "not_after": i.not_after.isoformat(),
                                 "expires_in_s": round((i.not_after - dt.datetime.now(
                                     dt.timezone.utc)).total_seconds())})
            print(json.dumps(rows, indent=2))
    except pki.PkiError as e:
        print(f"pdserve certs: {e}", file=sys.stderr)
        return 2
    return 0
