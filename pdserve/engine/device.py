"""Which device a worker computes on, in which dtype, and which GPU each worker of a host gets.

Owns the meaning of `--device auto|cpu|cuda|cuda:N` (`resolve_device`), the dtype a device
defaults to (`default_dtype`, `resolve_dtype`: bfloat16 on a GPU, float32 on the CPU; an
explicit dtype always wins), which `--quantization` runs with which device and dtype
(`check_quantization`: int8 weights on the CPU in float32 only), finding a host's visible GPUs
without torch (`visible_gpus`, from `CUDA_VISIBLE_DEVICES` and `nvidia-smi -L`), and the pure
plan of one device per worker (`assign_devices`, `plan_worker_devices`). GPU indexes are always
relative to the visible set, as CUDA numbers them inside a process that inherits
`CUDA_VISIBLE_DEVICES`.

Torch is imported only inside `resolve_device` (`cuda_available`), so the launcher and the
`serve` command import this module without it. Must not allocate on a device or load a model.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from pdserve.core.errors import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_CHOICES = ("none", "int8")

_DEVICE_RE = re.compile(r"(auto|cpu|cuda)(?::(\d+))?")


class DeviceError(ConfigError):
    """A device or dtype request that cannot be met; the message names the flag."""


def parse_device(text: str) -> tuple[str, int | None]:
    """("auto"|"cpu"|"cuda", index or None) of a `--device` value; a bad value raises."""
    m = _DEVICE_RE.fullmatch(text.strip().lower()) if isinstance(text, str) else None
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise DeviceError(f"--device must be auto, cpu, cuda or cuda:N, got {text!r}")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def cuda_available() -> tuple[bool, int]:
    """(whether torch can use CUDA here, how many devices it sees); imports torch."""
    import torch

    ok = torch.cuda.is_available()
    return ok, torch.cuda.device_count() if ok else 0


def resolve_device(text: str, *, probe=cuda_available) -> str:
    """The torch device string for a `--device` value: "cpu" or "cuda:N".

    auto is cuda:0 when CUDA is available, else cpu. cuda (or cuda:N) on a host where torch
    sees no CUDA device, or N past the visible devices, is an error naming `--device`.
    `probe` returns (available, count); tests pass their own.
    """
    kind, index = parse_device(text)
    if kind == "cpu":
        return "cpu"
    ok, count = probe()
    if kind == "auto":
        return "cuda:0" if ok and count > 0 else "cpu"
    if not ok or count == 0:
        raise DeviceError(f"--device {text}: torch sees no CUDA device here (a CPU-only torch "
                          f"build, no driver, or CUDA_VISIBLE_DEVICES hides them); use "
                          f"--device cpu or auto")
    index = index or 0
    if index >= count:
        raise DeviceError(f"--device {text}: only {count} CUDA device(s) are visible "
                          f"(cuda:0..cuda:{count - 1}; indexes count within "
                          f"CUDA_VISIBLE_DEVICES)")
    return f"cuda:{index}"


def default_dtype(device: str) -> str:
    """bfloat16 on a GPU (what vLLM and SGLang serve in), float32 on the CPU."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def resolve_dtype(dtype: str, device: str) -> str:
    """An explicit dtype as given; "auto" (or empty) the device's default."""
    if dtype in ("", "auto"):
        return default_dtype(device)
    if dtype not in DTYPE_CHOICES:
        raise DeviceError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    return dtype


def check_quantization(quantization: str, device: str, dtype: str) -> None:
    """Raise `DeviceError` naming `--quantization` when it cannot run with `device` and `dtype`.

    int8 (weight-only) has a CPU kernel only, and keeps activations in fp32: it needs the CPU
    and float32. An unresolved "auto" passes here; the engine checks again once it resolved
    them, so `auto` on a GPU host fails at load, not as wrong numbers.
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise DeviceError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                          f"got {quantization!r}")
    if quantization == "none":
        return
    kind, _ = parse_device(device)
    if kind not in ("cpu", "auto"):
        raise DeviceError(f"--quantization {quantization} runs on the CPU only, got --device "
                          f"{device} (use --device cpu)")
    if dtype not in ("", "auto", "float32"):
        raise DeviceError(f"--quantization {quantization} needs --dtype float32 (activations "
                          f"stay fp32), got --dtype {dtype}")


# ---- GPUs of this host, without torch ---------------------------------------------------------
def nvidia_smi_gpus(timeout_s: float = 5.0) -> list[str]:
    """`nvidia-smi -L` lines ("GPU 0: NVIDIA H200 (UUID: GPU-...)"); [] without the tool."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln for ln in out.stdout.splitlines() if ln.startswith("GPU ")] if out.returncode == 0 \
        else []


def visible_gpus(env: dict[str, str] | None = None, smi_lines: list[str] | None = None
                 ) -> list[str]:
    """The GPUs a child process would see, as ["cuda:0", "cuda:1", ...].

    The physical GPUs come from `nvidia-smi -L` (none when it is missing: then the workers'
    own `auto` decides). `CUDA_VISIBLE_DEVICES`, when set, selects among them as CUDA does:
    entries in order, up to the first one that names no GPU; "" or "-1" hides every GPU.
    """
    env = os.environ if env is None else env
    lines = nvidia_smi_gpus() if smi_lines is None else smi_lines
    n_physical = len(lines)
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return [f"cuda:{i}" for i in range(n_physical)]
    uuids = {m.group(1) for ln in lines for m in [re.search(r"UUID: ([^)\s]+)", ln)] if m}
    n = 0
    for entry in (e.strip() for e in spec.split(",")):
        if entry.isdigit() and int(entry) < n_physical:
            n += 1
        elif entry.startswith(("GPU-", "MIG-")) and any(u.startswith(entry) for u in uuids):
            n += 1
        else:
            break
    return [f"cuda:{i}" for i in range(n)]


# ---- one device per worker ---------------------------------------------------------------------
def assign_devices(n_workers: int, visible: list[str], *, share: bool = False) -> list[str]:
    """One distinct GPU of `visible` per worker, in order; more workers than GPUs is an error
    unless `share` (then workers go round-robin over the GPUs)."""
    if n_workers < 0:
        raise DeviceError(f"n_workers must be >= 0, got {n_workers}")
    if n_workers and not visible:
        raise DeviceError("--device cuda: no GPU is visible on this host (nvidia-smi -L lists "
                          "none, or CUDA_VISIBLE_DEVICES hides them); use --device cpu")
    if n_workers > len(visible) and not share:
        raise DeviceError(f"--device: {n_workers} workers need {n_workers} GPUs, but "
                          f"{len(visible)} visible ({', '.join(visible)}); start fewer "
                          f"workers, make more GPUs visible, or pass --share-gpus to put "
                          f"several workers on one GPU")
    return [visible[i % len(visible)] for i in range(n_workers)]


def plan_worker_devices(device: str, n_workers: int, visible: list[str], *,
                        share: bool = False) -> list[str]:
    """The `--device` each of a host's workers is started with.

    cpu: every worker on the CPU. cuda: one visible GPU each (`assign_devices`). cuda:N: every
    worker on that GPU (an explicit choice to share it). auto: as cuda when GPUs are visible,
    else "auto" (the host's GPUs could not be listed without torch: each worker decides).
    """
    kind, index = parse_device(device)
    if kind == "cpu":
        return ["cpu"] * n_workers
    if kind == "auto":
        return assign_devices(n_workers, visible, share=share) if visible else ["auto"] * n_workers
    if index is None:
        return assign_devices(n_workers, visible, share=share)
    if visible and index >= len(visible):
        raise DeviceError(f"--device {device}: only {len(visible)} GPU(s) are visible "
                          f"({', '.join(visible)})")
    return [f"cuda:{index}"] * n_workers


# ---- timing on a device --------------------------------------------------------------------------
# Peak HBM bandwidth from the vendors' data sheets, bytes/s, by a name fragment of
# `torch.cuda.get_device_name` (most specific first): the stated decode bound on that GPU.
STATED_HBM_BYTES_PER_S = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
                          ("A100-SXM4-80GB", 2.039e12),
                          ("A100 80GB", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12),
                          ("A10G", 0.6e12), ("L4", 0.3e12))


def stated_bandwidth(device_name: str) -> float | None:
    """The data-sheet HBM bandwidth of a GPU named `device_name`, bytes/s; None if unknown."""
    for fragment, bw in STATED_HBM_BYTES_PER_S:
        if fragment.lower() in device_name.lower():
            return bw
    return None


def synchronize(device: str) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU): a timer read after it counts
    the GPU's time, not just the launches."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def device_name(device: str) -> str:
    """The GPU's marketing name, or "cpu"."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return torch.cuda.get_device_name(device)
