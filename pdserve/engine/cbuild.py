"""Compiling a C source of the engine into a shared library on first use, cached by content.

Owns where such libraries live (`$PDSERVE_CACHE/<kind>`, default `~/.cache/pdserve/<kind>`), their
names (a hash of the source, the compiler and its flags, so an edit or another flag set builds
anew) and the build itself: `$CC` (default gcc) writes a temp file that is `os.replace`d into
place, so concurrent processes never load a half-written library. Failures raise the caller's
error type with the caller's name for the library (no compiler, a compile error), so each
backend says in its own words why it falls back.
`load` opens a library and checks its ABI; `load_first` tries a backend's flag sets in turn
and asks the library whether this CPU can run it, and `FirstUse` does that once, on first use
from any thread, keeping the library or the reason there is none (the linear kernels' shared
start-up). `KernelUnavailable` is every backend's error.
Must not call a library's compute functions or declare their signatures: each backend
(`kvcodec_cpu`, `paged_attn_cpu`, `linear_cpu`, `linear_int8`) does.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable


class KernelUnavailable(RuntimeError):
    """A C kernel cannot run here (no compiler, a build or load error, a CPU it does not
    support); the message names the kernel and why. Each backend raises and catches this one
    type and falls back to its reference path."""


class NoCompiler(KernelUnavailable):
    """No C compiler: other flag sets will not help either."""


def cache_dir(kind: str) -> Path:
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "pdserve")
    return Path(root) / kind


def compiler(what: str, error: type[Exception], hint: str = "") -> list[str]:
    """`$CC` split into words (default gcc); `error` naming `what` when it is not installed."""
    cc = shlex.split(os.environ.get("CC", "").strip() or "gcc")
    if shutil.which(cc[0]) is None:
        raise error(f"{what}: C compiler {cc[0]!r} not found (install gcc or set CC){hint}")
    return cc


def library_path(source: Path, flags: tuple[str, ...], kind: str, what: str,
                 error: type[Exception], hint: str = "") -> Path:
    """Where the library of `source` built with this compiler and `flags` lives (built or not)."""
    cc = compiler(what, error, hint)
    key = hashlib.sha256(source.read_bytes())
    key.update("\0".join(cc + list(flags)).encode())
    return cache_dir(kind) / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(source: Path, target: Path, flags: tuple[str, ...], what: str,
          error: type[Exception]) -> None:
    """Compile `source` into `target` atomically; `error` with the compiler's message if not."""
    cc = compiler(what, error)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [*cc, *flags, str(source), "-o", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except OSError as exc:
            raise error(f"{what}: cannot run {cc[0]!r}: {exc}") from exc
        if proc.returncode != 0:
            raise error(f"{what}: `{shlex.join(cmd)}` failed ({proc.returncode}):\n"
                        f"{proc.stderr[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder's identical file is fine to replace
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(source: Path, flags: tuple[str, ...], kind: str, what: str, error: type[Exception],
         no_compiler: type[Exception], abi_symbol: str, abi: int):
    """The library of `source` with `flags`, built first if missing, loaded with ctypes and
    checked to speak ABI `abi` (its `abi_symbol()`); `no_compiler` when there is no compiler,
    `error` for a build, load or ABI failure."""
    import ctypes

    path = library_path(source, flags, kind, what, no_compiler)
    if not path.exists():
        build(source, path, flags, what, error)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise error(f"{what}: cannot load {path}: {exc}") from exc
    got = getattr(lib, abi_symbol)()
    if got != abi:
        raise error(f"{what}: {path} has ABI {got}, want {abi}")
    return lib


def load_first(source: Path, flag_sets: tuple[tuple[str, ...], ...], kind: str, what: str,
               error: type[Exception], no_compiler: type[Exception], abi_symbol: str, abi: int,
               supported_symbol: str):
    """The library of `source` built with the first of `flag_sets` that builds and loads
    (`load`), if its `supported_symbol()` says this CPU can run it: (library, None), else
    (None, every reason, one per flag set tried). No compiler ends the search at once."""
    errors: list[str] = []
    for flags in flag_sets:
        try:
            lib = load(source, flags, kind, what, error, no_compiler, abi_symbol, abi)
        except no_compiler as exc:
            errors.append(str(exc))
            break
        except (error, OSError) as exc:
            errors.append(str(exc))
            continue
        if not getattr(lib, supported_symbol)():
            errors.append(f"{what}: this CPU has neither AVX-512F nor AVX2 with FMA")
            break
        return lib, None
    return None, "; ".join(errors) or f"{what}: unavailable"


class FirstUse:
    """A backend's library, loaded by `load_first` on first use (once, whichever thread asks
    first), or the reason it is not there. `declare(lib)` is the backend's: it sets the
    signatures of the compute functions before the library is handed out."""

    def __init__(self, source: Path, flag_sets: tuple[tuple[str, ...], ...], kind: str,
                 what: str, error: type[Exception], no_compiler: type[Exception],
                 abi_symbol: str, abi: int, supported_symbol: str,
                 declare: Callable[[Any], None]) -> None:
        self._args = (source, flag_sets, kind, what, error, no_compiler, abi_symbol, abi,
                      supported_symbol)
        self._what, self._error_type, self._supported = what, error, supported_symbol
        self._declare = declare
        self._lock = threading.Lock()
        self._tried = False
        self._lib: Any = None
        self.error: str | None = None

    def get(self):
        """The library, or None (the reason in `error`)."""
        if not self._tried:
            with self._lock:
                if not self._tried:
                    lib, self.error = load_first(*self._args)
                    if lib is not None:
                        self._declare(lib)
                    self._lib, self._tried = lib, True
        return self._lib

    def require(self):
        """The library, or the backend's error saying why there is none."""
        lib = self.get()
        if lib is None:
            raise self._error_type(self.error or self._what)
        return lib

    def available(self) -> bool:
        return self.get() is not None

    def unavailable_reason(self) -> str | None:
        self.get()
        return self.error

    def isa(self) -> str:
        """The instruction set the library runs on here: "avx512f" or "avx2"."""
        return "avx512f" if getattr(self.require(), self._supported)() == 2 else "avx2"
