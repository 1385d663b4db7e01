"""The local cluster's TLS: which certificates its processes get, and keeping them fresh.

Owns choosing the cluster's internal TLS (the spec's folder; else this process's own setting,
e.g. PDSERVE_TLS_DIR; else a new CA and a certificate per kind made in the log folder, which
this launcher then renews at two thirds of their life while the cluster runs), setting this
process up as the cluster's operator with it, and the router's client-port TLS files.
Must not start processes: `local.py` passes `security.cli.forward(...)` to each child.
"""

from __future__ import annotations

import logging
import os
import threading

from pdserve.launcher.cluster_spec import ClusterSpec
from pdserve.core.identity import OPERATOR
from pdserve.security import pki, tls

log = logging.getLogger(__name__)

RENEW_CHECK_S = 60.0


def internal_tls(spec: ClusterSpec, log_dir: str) -> tuple[tls.Security, bool]:
    """(this cluster's setting, as its operator; whether its CA was made here). This process
    is configured with it: the launcher calls the children as their operator."""
    if spec.insecure_internal:
        return tls.configure(tls.Insecure()), False
    if spec.tls_dir:
        return tls.configure(tls.MutualTls(tls.TlsFolder(spec.tls_dir), OPERATOR)), False
    try:
        mine = tls.current()
    except tls.NotConfigured:
        mine = None
    if isinstance(mine, tls.MutualTls) and mine.kind == OPERATOR:
        return mine, False
    folder = os.path.join(log_dir, "tls")
    pki.init_folder(folder, spec.cluster_id)
    return tls.configure(tls.MutualTls(tls.TlsFolder(folder), OPERATOR)), True


def public_tls(spec: ClusterSpec) -> dict[str, str]:
    """The router's TLS files for its client ports (`RouterConfig` fields; none for
    plaintext), as absolute paths: the same files whatever the router's working directory."""
    return {name: os.path.abspath(path) for name, path in (
        ("tls_cert", spec.tls_cert), ("tls_key", spec.tls_key),
        ("tls_client_ca", spec.tls_client_ca)) if path}


class Renewal:
    """Renews the certificates of a folder this launcher made, looking every `every_s`."""

    def __init__(self, folder: str, every_s: float = RENEW_CHECK_S) -> None:
        self.folder = folder
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="renew-certificates",
                                        daemon=True)

    def start(self) -> "Renewal":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def renew(self) -> list[str]:
        """The kinds whose certificates were due and are renewed now (the children re-read
        their files)."""
        return pki.renew_folder(self.folder)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                renewed = self.renew()
            except (OSError, ValueError) as e:  # try again at the next look
                log.warning("renewing the cluster's certificates failed: %s", e)
                continue
            if renewed:
                log.info("renewed the certificates of %s", ", ".join(renewed))
