"""Device selection: what `--device` means, the dtype each device defaults to, which GPUs a host
shows without torch, and one distinct GPU per worker (indexes relative to CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.engine.config import ConfigError
from pdserve.engine.device import (DeviceError, assign_devices, default_dtype,
                                   plan_worker_devices, resolve_device, resolve_dtype,
                                   stated_bandwidth, visible_gpus)

SMI = ["GPU 0: NVIDIA H200 (UUID: GPU-aaaa1111)", "GPU 1: NVIDIA H200 (UUID: GPU-bbbb2222)",
       "GPU 2: NVIDIA H200 (UUID: GPU-cccc3333)", "GPU 3: NVIDIA H200 (UUID: GPU-dddd4444)"]


def no_cuda():
    return False, 0


def two_gpus():
    return True, 2


@pytest.mark.parametrize("text,probe,want", [
    ("auto", no_cuda, "cpu"), ("auto", two_gpus, "cuda:0"), ("cpu", two_gpus, "cpu"),
    ("cuda", two_gpus, "cuda:0"), ("cuda:1", two_gpus, "cuda:1"), ("CUDA:1", two_gpus, "cuda:1"),
])
def test_resolve_device(text, probe, want):
    assert resolve_device(text, probe=probe) == want


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cpu:0", "cuda:-1", "", "auto:1", "mps"])
def test_a_bad_device_names_the_flag(text):
    with pytest.raises(DeviceError, match="--device"):
        resolve_device(text, probe=two_gpus)


def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(DeviceError, match=r"--device cuda.*no CUDA device.*--device cpu"):
        resolve_device("cuda", probe=no_cuda)
    with pytest.raises(DeviceError, match=r"only 2 CUDA device"):
        resolve_device("cuda:2", probe=two_gpus)


def test_device_errors_are_config_errors():
    """The worker's entry point turns a ConfigError into a usage error: so does a bad device."""
    assert issubclass(DeviceError, ConfigError)


def test_resolve_device_really_probes_torch_on_this_host():
    import torch

    want = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == want


def test_dtype_defaults_by_device_and_an_explicit_dtype_wins():
    assert default_dtype("cpu") == "float32"
    assert default_dtype("cuda:3") == "bfloat16"
    assert resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("float32", "cuda:0") == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(DeviceError, match="--dtype"):
        resolve_dtype("fp8", "cpu")


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus({}, SMI) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert visible_gpus({}, []) == []  # no nvidia-smi: none known
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, SMI) == ["cuda:0", "cuda:1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, SMI) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, SMI) == []
    # CUDA stops at the first entry that names no GPU.
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,7,2"}, SMI) == ["cuda:0"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-cccc,GPU-aaaa1111"}, SMI) == [
        "cuda:0", "cuda:1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0"}, []) == []


def test_one_distinct_gpu_per_worker():
    assert assign_devices(3, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]) == [
        "cuda:0", "cuda:1", "cuda:2"]
    assert assign_devices(0, []) == []
    with pytest.raises(DeviceError, match=r"3 workers need 3 GPUs, but 2 visible.*--share-gpus"):
        assign_devices(3, ["cuda:0", "cuda:1"])
    assert assign_devices(3, ["cuda:0", "cuda:1"], share=True) == ["cuda:0", "cuda:1", "cuda:0"]
    with pytest.raises(DeviceError, match="no GPU is visible"):
        assign_devices(1, [], share=True)


def test_worker_device_plan():
    gpus = ["cuda:0", "cuda:1"]
    assert plan_worker_devices("cpu", 2, gpus) == ["cpu", "cpu"]
    assert plan_worker_devices("auto", 2, gpus) == ["cuda:0", "cuda:1"]
    assert plan_worker_devices("auto", 2, []) == ["auto", "auto"]  # each worker decides
    assert plan_worker_devices("cuda", 2, gpus) == ["cuda:0", "cuda:1"]
    assert plan_worker_devices("cuda:1", 2, gpus) == ["cuda:1", "cuda:1"]
    with pytest.raises(DeviceError, match="--share-gpus"):
        plan_worker_devices("auto", 3, gpus)
    with pytest.raises(DeviceError, match="no GPU is visible"):
        plan_worker_devices("cuda", 2, [])
    with pytest.raises(DeviceError, match=r"cuda:2: only 2 GPU"):
        plan_worker_devices("cuda:2", 1, gpus)


def test_the_device_module_imports_without_torch():
    code = ("import sys, pdserve.engine.device as d; d.visible_gpus(); "
            "d.plan_worker_devices('auto', 2, [], share=True); "
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_stated_bandwidth_by_gpu_name():
    assert stated_bandwidth("NVIDIA H200") == 4.8e12
    assert stated_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert stated_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert stated_bandwidth("cpu") is None
