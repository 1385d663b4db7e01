"""The SSD tier of a storage node: one file per object in a directory, used bytes bounded.

Owns the object files (written with `os.pwrite`, read with `os.preadv` straight into the
caller's buffer), their publication (a write goes to a temporary file renamed into place, so a
reader sees a whole object or none) and the byte budget. Must not decide what to spill or when:
demotion and eviction are the master's decisions, the node only executes them.

Object ids are restricted to `[A-Za-z0-9._-]` (no leading dot, at most 200 characters) so an id
can never name a path outside the directory.
"""

from __future__ import annotations

import os
import re
import threading
import uuid

_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
_TMP_MARK = ".tmp-"


class SsdError(Exception):
    """An SSD tier operation failed; the message names the object and why."""


class SsdFullError(SsdError):
    """Storing the object would pass the tier's byte budget (RESOURCE_EXHAUSTED)."""


class SsdObjectNotFound(SsdError):
    """No committed object has this id."""


class InvalidObjectId(SsdError, ValueError):
    """The object id cannot be a file name here."""


def _check_id(obj_id: str) -> str:
    if not isinstance(obj_id, str) or not _ID.fullmatch(obj_id):
        raise InvalidObjectId(
            f"object id must match [A-Za-z0-9_-][A-Za-z0-9._-]{{0,199}}, got {obj_id!r}")
    return obj_id


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class SsdWriter:
    """One object being written: `write_at` pieces, then `commit` (publish) or `abort`.

    Its bytes are reserved against the tier's budget from `SsdTier.begin_write` until abort (or,
    after commit, until the object is removed or replaced).
    """

    def __init__(self, tier: SsdTier, obj_id: str, size_bytes: int):
        self.obj_id = obj_id
        self.size_bytes = size_bytes
        self._tier = tier
        self._tmp = os.path.join(tier.directory, f"{obj_id}{_TMP_MARK}{uuid.uuid4().hex}")
        self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

    def write_at(self, offset: int, data: memoryview | bytes | bytearray) -> None:
        view = memoryview(data).cast("B")
        if self._fd is None:
            raise SsdError(f"writer of {self.obj_id} is finished")
        if offset < 0 or offset + len(view) > self.size_bytes:
            raise SsdError(f"write [{offset}, {offset + len(view)}) outside object "
                           f"{self.obj_id} of {self.size_bytes} bytes")
        _pwrite_all(self._fd, view, offset)

    def commit(self) -> None:
        """Makes the object visible under its id (replacing an older one of that id)."""
        fd, self._fd = self._fd, None
        if fd is None:
            raise SsdError(f"writer of {self.obj_id} is finished")
        try:
            # Set the exact size even if the tail was never written, so readers can trust it.
            os.ftruncate(fd, self.size_bytes)
            if self._tier.fsync:
                os.fsync(fd)
        except OSError:
            os.close(fd)
            self._discard()
            raise
        os.close(fd)
        self._tier._publish(self)

    def abort(self) -> None:
        """Drops the partial object and its reservation. Idempotent; a no-op after commit."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            self._discard()

    def _discard(self) -> None:
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass
        self._tier._release(self.size_bytes)

    def __enter__(self) -> SsdWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None and self._fd is not None:
            self.commit()
        else:
            self.abort()


class SsdTier:
    """Objects as files under `directory`, at most `capacity_bytes` of them (sum of sizes)."""

    def __init__(self, directory: str, capacity_bytes: int, fsync: bool = False,
                 adopt: bool = True):
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise SsdError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        # fsync on commit survives power loss; off by default because the store is a cache
        # (a lost object is recomputed) and fsync costs milliseconds per object.
        self.fsync = fsync
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._used_bytes = 0  # committed objects plus writes in progress
        self._scan_existing(adopt)

    def _scan_existing(self, adopt: bool) -> None:
        """Objects left by an earlier run: counted (`adopt`, so the budget holds) or deleted.

        Partial writes are always deleted. Only names this tier could have made are touched.
        """
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if not os.path.isfile(path) or not _ID.fullmatch(name.split(_TMP_MARK)[0]):
                continue
            if _TMP_MARK in name or not adopt:
                os.unlink(path)
            else:
                self._sizes[name] = os.path.getsize(path)
                self._used_bytes += self._sizes[name]
        if self._used_bytes > self.capacity_bytes:
            raise SsdFullError(f"{self.directory} already holds {self._used_bytes} bytes, more "
                               f"than capacity_bytes={self.capacity_bytes}")

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def _path(self, obj_id: str) -> str:
        return os.path.join(self.directory, _check_id(obj_id))

    def __contains__(self, obj_id: str) -> bool:
        return obj_id in self._sizes

    def size_of(self, obj_id: str) -> int:
        try:
            return self._sizes[obj_id]
        except KeyError:
            raise SsdObjectNotFound(f"no object {obj_id!r} on SSD tier {self.directory}") from None

    def begin_write(self, obj_id: str, size_bytes: int) -> SsdWriter:
        """Reserves `size_bytes` and opens a writer; SsdFullError if the budget cannot take it."""
        _check_id(obj_id)
        if not isinstance(size_bytes, int) or size_bytes < 0:
            raise SsdError(f"size_bytes must be a non-negative integer, got {size_bytes!r}")
        with self._lock:
            if self._used_bytes + size_bytes > self.capacity_bytes:
                raise SsdFullError(
                    f"SSD tier full: {self._used_bytes} + {size_bytes} bytes > capacity "
                    f"{self.capacity_bytes} (object {obj_id!r})")
            self._used_bytes += size_bytes
        try:
            return SsdWriter(self, obj_id, size_bytes)
        except OSError as e:
            self._release(size_bytes)
            raise SsdError(f"cannot create object {obj_id!r} in {self.directory}: {e}") from None

    def write(self, obj_id: str, data: memoryview | bytes | bytearray) -> None:
        """Stores `data` as object `obj_id` (replacing an older one); whole or not at all."""
        view = memoryview(data).cast("B")
        with self.begin_write(obj_id, len(view)) as writer:
            writer.write_at(0, view)

    def read_into(self, obj_id: str, buf: memoryview | bytearray, offset: int = 0) -> int:
        """Fills `buf` with the object's bytes from `offset`; returns len(buf).

        The range [offset, offset + len(buf)) must lie inside the object (SsdError otherwise).
        """
        view = memoryview(buf).cast("B")
        with self.open(obj_id) as f:
            size = os.fstat(f.fileno()).st_size
            if offset < 0 or offset + len(view) > size:
                raise SsdError(f"read [{offset}, {offset + len(view)}) outside object "
                               f"{obj_id!r} of {size} bytes")
            done = 0
            while done < len(view):
                n = os.preadv(f.fileno(), [view[done:]], offset + done)
                if n == 0:
                    raise SsdError(f"object {obj_id!r} shorter than its recorded size")
                done += n
        return done

    def open(self, obj_id: str):  # -> io.FileIO; the caller closes it
        """The committed object's file, unbuffered, for reading (e.g. `socket.sendfile`).

        An open file keeps its bytes even if the object is removed or replaced meanwhile.
        """
        path = self._path(obj_id)
        if obj_id not in self._sizes:
            raise SsdObjectNotFound(f"no object {obj_id!r} on SSD tier {self.directory}")
        try:
            return open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise SsdObjectNotFound(f"object {obj_id!r} vanished from {self.directory}") from None

    def remove(self, obj_id: str) -> None:
        """Deletes the object and frees its bytes; SsdObjectNotFound if there is none."""
        path = self._path(obj_id)
        with self._lock:
            size = self._sizes.pop(obj_id, None)
            if size is None:
                raise SsdObjectNotFound(f"no object {obj_id!r} on SSD tier {self.directory}")
            self._used_bytes -= size
            os.unlink(path)

    def _publish(self, writer: SsdWriter) -> None:
        with self._lock:
            os.replace(writer._tmp, os.path.join(self.directory, writer.obj_id))
            old = self._sizes.get(writer.obj_id)
            self._sizes[writer.obj_id] = writer.size_bytes
            if old is not None:
                self._used_bytes -= old

    def _release(self, size_bytes: int) -> None:
        with self._lock:
            self._used_bytes -= size_bytes
