"""A small step-time profile with the agreed `StepProfile` interface, for the simulator's tests
(linear in tokens and context; numbers of the order of a GPU serving an 8B model)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinearProfile:
    origin: str = "test: linear stand-in"
    model: str = "test"
    prefill_per_token_s: float = 50e-6
    prefill_context_s: float = 2e-6  # per cached token in the step
    step_overhead_s: float = 0.005
    decode_per_seq_s: float = 0.0002
    decode_per_context_s: float = 2e-8
    bandwidth_bps: float = 10e9
    transfer_latency_s: float = 0.001
    kv_bytes_per_token: int = 131072
    flip_s: float = 2.0
    startup_s: float = 30.0
    kv_capacity_tokens: int = 200_000

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        return (self.step_overhead_s + new_tokens * self.prefill_per_token_s
                + cached_tokens * self.prefill_context_s)

    def decode_s(self, batch: int, context_tokens: int) -> float:
        return (self.step_overhead_s + batch * self.decode_per_seq_s
                + context_tokens * self.decode_per_context_s)

    def mixed_s(self, prefill_tokens: int, decode_batch: int, context_tokens: int) -> float:
        return (self.decode_s(decode_batch, context_tokens)
                + prefill_tokens * self.prefill_per_token_s)

    def transfer_s(self, nbytes: int, transport: str) -> float:
        return self.transfer_latency_s + nbytes / self.bandwidth_bps
