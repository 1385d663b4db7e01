"""The certificates of a pdserve cluster on Ray, on the driver's side.

Owns the driver's TLS folder of a cluster: the user's (`--tls-dir`, or `PDSERVE_TLS_DIR`), used
as it is; else one kept per cluster name on the driver's machine (`ray/<cluster>/tls` under
the user's state folder: `$PDSERVE_STATE_DIR`, else `$XDG_STATE_HOME/pdserve`, else
`~/.local/state/pdserve`; 0700, the CA's key 0600 and never sent anywhere), made by the first
`serve` of that name and reused by every later one and by `pdserve ray renew-certs`. Owns the
certificates' lifetime on Ray (`LIFETIME_S`, 30 days: nothing renews them while the driver is
detached), issuing each member a certificate of its kind named after it (`worker/prefill-0`),
and the bundle one actor receives (`bundle_names`): `ca.crt` and its own kind's certificate and
key, nothing else. Must not talk to Ray (`backend.py` hands the bundles over) nor write on a
Ray node (`actor.py` does).
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Callable
from dataclasses import dataclass

from pdserve import runfile
from pdserve.core.identity import Identity
from pdserve.security import pki

# Long enough for a detached cluster between two deliberate renewals (`pdserve ray
# renew-certs`, or serving the name again), short enough that a key copied off a node lapses.
LIFETIME_S = 30 * 24 * 3600.0


class CertError(ValueError):
    """The driver's TLS folder is missing or unusable; the message names it."""


def state_folder(cluster_id: str) -> str:
    """The driver's TLS folder of Ray cluster `cluster_id` (a checked name: no path parts)."""
    return os.path.join(os.path.dirname(runfile.path()), "ray", cluster_id, "tls")


def bundle_names(kind: str) -> tuple[str, str, str]:
    """The files an actor of `kind` receives and writes: the CA's certificate, its own."""
    return (pki.CA_CERT, pki.cert_file(kind), pki.key_file(kind))


@dataclass(frozen=True)
class Issuer:
    """Hands out members' bundles from a TLS folder: certificates issued per member when the
    folder holds the CA's key, else the folder's own certificate of each kind."""

    folder: str
    has_ca_key: bool
    lifetime_s: float = LIFETIME_S

    def _file(self, name: str) -> bytes:
        return pki.read(os.path.join(self.folder, name))

    def bundle(self, member: str, kind: str) -> dict[str, bytes]:
        ca_cert = self._file(pki.CA_CERT)
        if self.has_ca_key:
            key, cert = pki.issue(self._file(pki.CA_KEY), ca_cert, Identity(kind, member),
                                  self.lifetime_s)
        else:
            key, cert = self._file(pki.key_file(kind)), self._file(pki.cert_file(kind))
        return dict(zip(bundle_names(kind), (ca_cert, cert, key)))

    def expires(self) -> dt.datetime:
        """When the CA's certificate ends (no member's certificate outlives it)."""
        return pki.info(self._file(pki.CA_CERT)).not_after


def issuer(cluster_id: str, tls_dir: str | None, lifetime_s: float = LIFETIME_S,
           make: bool = True, say: Callable[[str], None] = lambda _: None) -> Issuer:
    """The issuer of cluster `cluster_id`'s certificates: from `tls_dir` when given, else from
    the driver's folder, made (`make`) when it holds no CA yet or its CA would end within
    `lifetime_s`; the driver's own certificates there (the operator's, for `pdserve ctl`) are
    renewed once 2/3 of their life has passed."""
    if tls_dir:
        folder = os.path.abspath(tls_dir)
        if not os.path.isfile(os.path.join(folder, pki.CA_CERT)):
            raise CertError(f"--tls-dir {folder}: no {pki.CA_CERT}")
        return Issuer(folder, os.path.isfile(os.path.join(folder, pki.CA_KEY)), lifetime_s)
    folder = state_folder(cluster_id)
    have = os.path.isfile(os.path.join(folder, pki.CA_KEY))
    if not have and not make:
        raise CertError(f"no CA of cluster {cluster_id} in {folder} (`pdserve serve --backend "
                        f"ray --cluster {cluster_id}` on this machine makes one)")
    now = dt.datetime.now(dt.timezone.utc)
    if have and make and Issuer(folder, True).expires() < now + dt.timedelta(seconds=lifetime_s):
        say(f"the CA in {folder} ends before new certificates would: making a new one")
        have = False
    if not have:
        os.makedirs(os.path.dirname(folder), mode=0o700, exist_ok=True)
        pki.init_folder(folder, cluster_id, lifetime_s=lifetime_s)
        say(f"made cluster {cluster_id}'s CA in {folder}")
    else:
        os.chmod(folder, 0o700)
        pki.renew_folder(folder, lifetime_s)
    return Issuer(folder, True, lifetime_s)
