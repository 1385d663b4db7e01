"""Leader election among HA masters through one Redis lease key.

Owns acquiring, renewing, releasing and reading the lease: `SET key candidate NX PX lease_ms`
to acquire; Lua compare-and-renew / compare-and-delete so only the holder can extend or give it
up. Expiry is Redis's clock, so candidates need no synchronised clocks. Each successful
acquisition bumps `{key}:epoch`; the epoch is a fencing token the leader can attach to writes.
Must not run timers or threads: the adapter calls `renew` well within `lease_s` (e.g. every
lease_s / 3) and steps down when it returns False.
"""

from __future__ import annotations

from typing import Any

from pdserve.core.errors import ConfigError

# Acquire: SET NX PX, and on success bump the epoch, atomically.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return 0
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class LeaderElection:
    """One candidate's view of the lease `key` (value: the holder's candidate_id)."""

    def __init__(self, redis_client: Any, key: str, candidate_id: str, lease_s: float) -> None:
        if not isinstance(candidate_id, str) or not candidate_id:
            raise ConfigError(f"candidate_id must be a non-empty string, got {candidate_id!r}")
        if not isinstance(lease_s, (int, float)) or not lease_s >= 0.001:
            raise ConfigError(f"lease_s must be at least 0.001 seconds, got {lease_s!r}")
        self.redis = redis_client
        self.key = key
        self.epoch_key = f"{key}:epoch"
        self.candidate_id = candidate_id
        self.lease_ms = int(round(lease_s * 1000))
        self.epoch = 0  # the fencing token of our latest acquisition
        self._acquire = redis_client.register_script(_ACQUIRE)
        self._renew = redis_client.register_script(_RENEW)
        self._release = redis_client.register_script(_RELEASE)

    def try_acquire(self) -> bool:
        """Takes the lease if nobody holds it; if we already hold it, renews it. True when we
        are the leader afterwards."""
        epoch = int(self._acquire(keys=[self.key, self.epoch_key],
                                  args=[self.candidate_id, self.lease_ms]))
        if epoch:
            self.epoch = epoch
            return True
        return self.renew()

    def renew(self) -> bool:
        """Extends the lease if we hold it; False if it expired or someone else holds it."""
        return bool(self._renew(keys=[self.key], args=[self.candidate_id, self.lease_ms]))

    def release(self) -> bool:
        """Gives the lease up if we hold it (a clean stand-down); never deletes another's."""
        return bool(self._release(keys=[self.key], args=[self.candidate_id]))

    def current_leader(self) -> str | None:
        return _text(self.redis.get(self.key))

    def is_leader(self) -> bool:
        return self.current_leader() == self.candidate_id
