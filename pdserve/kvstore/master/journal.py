"""Durable master metadata: an append-only log of journal records plus snapshots.

Owns getting `MasterCore` records and snapshots onto durable storage and back: `FileJournal`
(a directory: JSON-lines log, snapshot written atomically; the embedded default) and
`RedisJournal` (a Redis list plus a snapshot key; the cluster default, so any master can take
over). Must not interpret records (the core applies them) or decide when to snapshot.

Protocol for the adapter: drain `core.take_journal()` into `append` after every core call that
changed state (before replying); when `core.snapshot_due()`, call
`write_snapshot(core.snapshot(), snapshot["journal_seq"])`. On start,
`MasterCore.restore(config, *journal.load(), now_s)`. A crash between writing a snapshot and
trimming the log leaves records the snapshot already covers: `load` drops them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

from pdserve.kvstore.master.model import MasterError, Record


class JournalError(MasterError):
    """The journal's stored data is unreadable, or records arrive out of sequence."""


class Journal(Protocol):
    def append(self, records: Sequence[Record]) -> None:
        """Makes `records` durable, in order; their seqs must exceed every seq appended."""

    def write_snapshot(self, snapshot: dict[str, Any], upto_seq: int) -> None:
        """Stores `snapshot` (state after record `upto_seq`) and drops records it covers."""

    def load(self) -> tuple[dict[str, Any] | None, list[Record]]:
        """The latest snapshot (None if none) and the records after it, in seq order."""


def _encode(record: Record) -> str:
    return json.dumps(record.to_dict(), separators=(",", ":"), allow_nan=False)


def _decode(line: str | bytes, where: str) -> Record:
    try:
        return Record.from_dict(json.loads(line))
    except (ValueError, MasterError) as e:
        raise JournalError(f"{where}: unreadable journal record: {e}") from None


def _check_order(last_seq: int, records: Sequence[Record]) -> int:
    for r in records:
        if r.seq <= last_seq:
            raise JournalError(f"record seq {r.seq} does not follow seq {last_seq}")
        last_seq = r.seq
    return last_seq


def _snapshot_doc(snapshot: dict[str, Any], upto_seq: int) -> str:
    return json.dumps({"upto_seq": upto_seq, "snapshot": snapshot}, allow_nan=False)


def _read_snapshot_doc(text: str | bytes | None, where: str) -> tuple[dict | None, int]:
    if text is None:
        return None, 0
    try:
        doc = json.loads(text)
        return doc["snapshot"], int(doc["upto_seq"])
    except (ValueError, KeyError, TypeError) as e:
        raise JournalError(f"{where}: unreadable snapshot: {e!r}") from None


class FileJournal:
    """`dir/journal.log` (one JSON record per line) and `dir/snapshot.json`.

    `fsync=True` makes each append durable against power loss before it returns (slower);
    False leaves it to the OS (durable against a process crash only).
    """

    def __init__(self, directory: str | os.PathLike, fsync: bool = True) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.log_path = self.dir / "journal.log"
        self.snapshot_path = self.dir / "snapshot.json"
        self._repair_torn_tail()
        snapshot, records = self.load()
        self._last_seq = records[-1].seq if records else self._snapshot_seq()

    def _snapshot_seq(self) -> int:
        if not self.snapshot_path.exists():
            return 0
        return _read_snapshot_doc(self.snapshot_path.read_bytes(), str(self.snapshot_path))[1]

    def _repair_torn_tail(self) -> None:
        """A crash mid-append can leave a last line without its newline: cut it off, so the
        next append does not glue a record onto it. That record was never acknowledged."""
        if not self.log_path.exists():
            return
        data = self.log_path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.log_path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
                self._sync(f)

    def _sync(self, f) -> None:
        if self.fsync:
            f.flush()
            os.fsync(f.fileno())

    def _sync_dir(self) -> None:
        if self.fsync:
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def append(self, records: Sequence[Record]) -> None:
        if not records:
            return
        last = _check_order(self._last_seq, records)
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write("".join(_encode(r) + "\n" for r in records))
            f.flush()
            self._sync(f)
        self._last_seq = last

    def write_snapshot(self, snapshot: dict[str, Any], upto_seq: int) -> None:
        # Snapshot first (write a temp file, then rename over: readers see old or new, never
        # half), then the log without the records it covers, the same way.
        self._atomic_write(self.snapshot_path, _snapshot_doc(snapshot, upto_seq))
        records = self._read_log(after_seq=upto_seq)
        self._atomic_write(self.log_path, "".join(_encode(r) + "\n" for r in records))
        self._last_seq = max(self._last_seq, upto_seq)

    def _atomic_write(self, path: Path, text: str) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            self._sync(f)
        os.replace(tmp, path)
        self._sync_dir()

    def _read_log(self, after_seq: int) -> list[Record]:
        if not self.log_path.exists():
            return []
        lines = self.log_path.read_text(encoding="utf-8").split("\n")
        records = []
        for i, line in enumerate(lines):
            if not line:
                continue
            if i == len(lines) - 1:
                break  # a torn last line (no newline yet): never acknowledged, skip it
            records.append(_decode(line, f"{self.log_path}:{i + 1}"))
        _check_order(0, records)
        return [r for r in records if r.seq > after_seq]

    def load(self) -> tuple[dict[str, Any] | None, list[Record]]:
        snapshot, upto = (None, 0)
        if self.snapshot_path.exists():
            snapshot, upto = _read_snapshot_doc(self.snapshot_path.read_bytes(),
                                                str(self.snapshot_path))
        return snapshot, self._read_log(after_seq=upto)


class JournalFenced(JournalError):
    """This master lost the leader lease: its writes are refused; it must step down."""


# RPUSH only if KEYS[1] (the leader lease) holds ARGV[1] (our candidate id).
_FENCED_RPUSH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('RPUSH', KEYS[2], unpack(ARGV, 2))
return 1
"""


class RedisJournal:
    """`{prefix}:log` (a list of JSON records, RPUSHed) and `{prefix}:snapshot` (a string).

    Writing a snapshot sets the snapshot key and trims the records it covers in one MULTI/EXEC
    transaction, WATCHing the log so a concurrent append cannot be trimmed by mistake.
    `redis_client` is a `redis.Redis` (bytes or decoded responses both work).
    """

    def __init__(self, redis_client: Any, prefix: str = "pdserve:kvstore:master",
                 fence: tuple[str, str] | None = None) -> None:
        self.redis = redis_client
        self.log_key = f"{prefix}:log"
        self.snapshot_key = f"{prefix}:snapshot"
        # fence = (leader lease key, our candidate id): appends land only while we hold the
        # lease, checked inside Redis in the same script as the RPUSH, so a deposed leader that
        # has not noticed yet cannot write after its successor has loaded the log.
        self.fence = fence
        self._fenced_push = redis_client.register_script(_FENCED_RPUSH) if fence else None
        tail = self.redis.lindex(self.log_key, -1)
        self._last_seq = (_decode(tail, self.log_key).seq if tail is not None
                          else _read_snapshot_doc(self.redis.get(self.snapshot_key),
                                                  self.snapshot_key)[1])

    def append(self, records: Sequence[Record]) -> None:
        if not records:
            return
        last = _check_order(self._last_seq, records)
        encoded = [_encode(r) for r in records]
        if self._fenced_push is None:
            self.redis.rpush(self.log_key, *encoded)
        elif not int(self._fenced_push(keys=[self.fence[0], self.log_key],
                                       args=[self.fence[1], *encoded])):
            raise JournalFenced(f"not the lease holder of {self.fence[0]} any more; "
                                f"{len(records)} records not written")
        self._last_seq = last

    def write_snapshot(self, snapshot: dict[str, Any], upto_seq: int) -> None:
        import redis  # the client library is only needed where this class is used

        doc = _snapshot_doc(snapshot, upto_seq)
        while True:
            with self.redis.pipeline() as pipe:
                try:
                    pipe.watch(self.log_key)
                    entries = pipe.lrange(self.log_key, 0, -1)
                    covered = sum(1 for e in entries if _decode(e, self.log_key).seq <= upto_seq)
                    pipe.multi()
                    pipe.set(self.snapshot_key, doc)
                    pipe.ltrim(self.log_key, covered, -1)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue  # the log changed under us: count again
        self._last_seq = max(self._last_seq, upto_seq)

    def load(self) -> tuple[dict[str, Any] | None, list[Record]]:
        with self.redis.pipeline() as pipe:  # MULTI/EXEC: snapshot and log from one instant
            pipe.get(self.snapshot_key)
            pipe.lrange(self.log_key, 0, -1)
            raw_snapshot, entries = pipe.execute()
        snapshot, upto = _read_snapshot_doc(raw_snapshot, self.snapshot_key)
        records = [_decode(e, self.log_key) for e in entries]
        _check_order(0, records)
        return snapshot, [r for r in records if r.seq > upto]
