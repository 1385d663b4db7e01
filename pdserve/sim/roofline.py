"""Step-time profiles for GPUs this project cannot measure, from a roofline of the model's shape.

Owns the model shapes (Llama-3-8B, Llama-2-7B), the GPU constants (dense bf16 peak FLOP/s, HBM
bandwidth and size, host link, NIC), the efficiency and overhead assumptions, and
`roofline_profile(gpu, model)`: per step max(FLOPs / (peak * eff), bytes / (HBM bw * eff)) plus
a fixed overhead, written as a `StepProfile` labelled "roofline: ..." with every constant in its
`fit` field. `python -m pdserve.sim.roofline` rewrites the shipped GPU profiles.
Must not measure anything or import torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.core.step_profile import ProfileError, StepProfile, TransportLink

GiB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2  # bf16

    @property
    def matmul_params(self) -> int:
        """Weights one token multiplies through: every layer's projections and the LM head."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        """Every weight read once per step (projections, LM head; the embedding rows are few)."""
        return self.matmul_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attn_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair over all layers and heads: QK^T and the AV product."""
        return 4 * self.layers * self.heads * self.head_dim


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: float        # dense bf16, FLOP/s
    hbm_bytes_per_s: float
    hbm_bytes: int
    host_link_bytes_per_s: float  # PCIe to pinned host memory (the store's DRAM tier)
    nic_bytes_per_s: float        # RDMA NIC per GPU (UCX)


MODELS = {
    "llama3-8b": ModelShape("Llama-3-8B", layers=32, hidden=4096, heads=32, kv_heads=8,
                            head_dim=128, intermediate=14336, vocab=128256),
    "llama2-7b": ModelShape("Llama-2-7B", layers=32, hidden=4096, heads=32, kv_heads=32,
                            head_dim=128, intermediate=11008, vocab=32000),
}

GPUS = {
    "h100": GpuSpec("H100 SXM", 989.4e12, 3.35e12, 80 * 10**9, 50e9, 50e9),
    "h200": GpuSpec("H200", 989.4e12, 4.8e12, 141 * 10**9, 50e9, 50e9),
    "a100": GpuSpec("A100 SXM 80GB", 312e12, 2.039e12, 80 * 10**9, 25e9, 25e9),
}

# Assumptions, stated in every profile's `fit`: achieved fractions of peak (large prefill GEMMs
# reach about half of peak; streaming weights and KV reaches most of HBM bandwidth), a per-step
# launch and scheduling cost, the share of HBM the KV cache gets, and role-switch and start-up
# costs (a switch keeps the weights loaded; start-up reads them from local NVMe).
ASSUMPTIONS = {
    "compute_efficiency": 0.5,
    "memory_efficiency": 0.8,
    "overhead_s": 0.002,
    "gpu_memory_utilization": 0.9,
    "activation_reserve_bytes": 4 * GiB,
    "flip_s": 1.0,
    "startup_init_s": 20.0,
    "weight_load_bytes_per_s": 2e9,
    "tcp_bytes_per_s": 5e9,
    "link_efficiency": 0.8,
}


def roofline_profile(gpu: str, model: str, **overrides: float) -> StepProfile:
    """The roofline `StepProfile` of `model` (a key of MODELS) on `gpu` (a key of GPUS)."""
    if gpu not in GPUS:
        raise ProfileError(f"gpu {gpu!r} is not one of {', '.join(GPUS)}")
    if model not in MODELS:
        raise ProfileError(f"model {model!r} is not one of {', '.join(MODELS)}")
    unknown = sorted(set(overrides) - set(ASSUMPTIONS))
    if unknown:
        raise ProfileError(f"unknown roofline assumption(s): {', '.join(unknown)}")
    a = {**ASSUMPTIONS, **overrides}
    g, m = GPUS[gpu], MODELS[model]
    flops_s = g.peak_flops * a["compute_efficiency"]
    bytes_s = g.hbm_bytes_per_s * a["memory_efficiency"]
    kv_capacity = int((g.hbm_bytes * a["gpu_memory_utilization"] - m.weight_bytes
                       - a["activation_reserve_bytes"]) // m.kv_bytes_per_token)
    if kv_capacity <= 0:
        raise ProfileError(f"{m.name} does not fit on one {g.name}")
    eff = a["link_efficiency"]
    transports = {
        "shm": TransportLink(10e-6, g.host_link_bytes_per_s * eff),
        "ucx": TransportLink(20e-6, g.nic_bytes_per_s * eff),
        "tcp": TransportLink(100e-6, a["tcp_bytes_per_s"]),
    }
    origin = (f"roofline: {g.name} {g.peak_flops / 1e12:.0f} TFLOP/s bf16 x "
              f"{a['compute_efficiency']}, {g.hbm_bytes_per_s / 1e12:.2f} TB/s x "
              f"{a['memory_efficiency']}, +{a['overhead_s'] * 1e3:.1f} ms/step; {m.name} bf16")
    return StepProfile(
        origin=origin, model=m.name, overhead_s=a["overhead_s"],
        prefill_token_s=2 * m.matmul_params / flops_s,
        prefill_attn_s=m.attn_flops_per_pair / flops_s,
        decode_seq_s=2 * m.matmul_params / flops_s,
        decode_ctx_s=m.attn_flops_per_pair / flops_s,
        weights_read_s=m.weight_bytes / bytes_s,
        kv_read_token_s=m.kv_bytes_per_token / bytes_s,
        transports=transports, kv_bytes_per_token=m.kv_bytes_per_token,
        flip_s=a["flip_s"],
        startup_s=a["startup_init_s"] + m.weight_bytes / a["weight_load_bytes_per_s"],
        kv_capacity_tokens=kv_capacity,
        fit={"method": "roofline", "gpu": asdict(g), "model_shape": asdict(m),
             "assumptions": a},
    )


SHIPPED_ROOFLINES = {"h100-llama3-8b": ("h100", "llama3-8b"),
                     "h200-llama3-8b": ("h200", "llama3-8b"),
                     "a100-llama2-7b": ("a100", "llama2-7b"),
                     "h100-llama2-7b": ("h100", "llama2-7b")}


def write_shipped(folder: Path) -> list[Path]:
    """Write every shipped roofline profile into `folder`; returns the paths."""
    paths = []
    for name, (gpu, model) in SHIPPED_ROOFLINES.items():
        path = folder / f"{name}.json"
        roofline_profile(gpu, model).save(path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_shipped(Path(__file__).parent.parent / "core" / "profiles"):
        print(p)
