"""What `pdserve bench serve` compares the cluster with: the engine alone, and other servers.

Owns the ceiling (`engine_ceiling`: `pdserve bench decode`'s own measurement functions run in
this process, after the cluster has stopped, with the decode worker's thread count, on the
workload's own prompt ids at each batch size), writing a Hugging Face folder from a GGUF with
transformers (what vLLM loads; fp32, the weights dequantized), and a baseline OpenAI server as
a child process (`BaselineServer`: vLLM's `vllm.entrypoints.openai.api_server`, or
llama-cpp-python's `llama_cpp.server` on the GGUF itself) that is started, awaited until its
`/v1/models` answers, and stopped with its whole process group.
Must not change what it measures: every server gets the workload through the same client.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.bench.serve_summary import engine_rate


def engine_ceiling(model_path: str, prompts: dict[int, Sequence[Sequence[int]]], new_tokens: int,
                   threads: int, dtype: str = "float32", repeats: int = 2,
                   quantization: str = "none",
                   progress: Callable[[str], None] = lambda what: None) -> dict[str, Any]:
    """The engine's decode tokens/s per batch size (batch b runs `prompts[b]`, b prompts) with
    `threads` torch threads: a warm-up run, then the median of `repeats` timed runs."""
    import torch

    from pdserve.bench.decode import DecodeBenchSettings, engine_decode_s, make_engine

    longest = max(len(p) for ps in prompts.values() for p in ps)
    s = DecodeBenchSettings(batch_sizes=tuple(sorted(prompts)), prompt_tokens=longest,
                            new_tokens=new_tokens, prefill_tokens=longest, dtype=dtype,
                            quantization=quantization, repeats=repeats)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        progress("engine: loading")
        engine = make_engine(model_path, s)
        salt = iter(range(1 << 30))
        rows = []
        for b in s.batch_sizes:
            times = []
            for r in range(1 + repeats):  # r == 0 warms up and is dropped
                progress(f"engine: batch {b}, run {r}/{repeats}")
                t = engine_decode_s(engine, [list(p) for p in prompts[b]], new_tokens,
                                    f"bench-serve-{next(salt)}")
                if r:
                    times.append(t)
            rows.append(engine_rate(b, new_tokens, times))
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "dtype": dtype, "quantization": quantization,
            "new_tokens": new_tokens,
            "repeats": repeats, "levels": rows}


def hf_folder(model_path: str, cache_root: str | None = None,
              progress: Callable[[str], None] = lambda what: None) -> str:
    """An HF folder for `model_path`: itself if it is one, else (a GGUF file) a folder written
    once with transformers (fp32 weights and the tokenizer with its chat template) and reused."""
    if os.path.isdir(model_path):
        return model_path
    st = os.stat(model_path)
    stem = os.path.splitext(os.path.basename(model_path))[0]
    root = cache_root or os.path.join(tempfile.gettempdir(), "pdserve-bench-serve-hf")
    out = os.path.join(root, f"{stem}-{st.st_size}-{int(st.st_mtime)}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    progress(f"writing an HF folder from {os.path.basename(model_path)}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.bench.decode import load_hf

    # transformers will not save a model it loaded from a GGUF: its dequantized weights go
    # into a plain model of the same config instead.
    src = load_hf(model_path, "float32")
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    model.load_state_dict(src.state_dict())
    del src
    tok = AutoTokenizer.from_pretrained(os.path.dirname(model_path),
                                        gguf_file=os.path.basename(model_path))
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out) + ".", dir=_mkdirs(root))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a failure's leftovers
    return out


def _mkdirs(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def vllm_argv(python: str, hf_dir: str, port: int, name: str, max_model_len: int
              ) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
            "--served-model-name", name, "--dtype", "float32", "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", str(max_model_len), "--seed", "0"]


def llamacpp_argv(python: str, gguf: str, port: int, name: str, threads: int,
                  max_model_len: int) -> list[str]:
    # By default its server cuts a streaming request short when the next one arrives; the
    # others then wait their turn, as a user of the server sees it serving one at a time.
    return [python, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", name,
            "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
            "--n_ctx", str(max_model_len), "--interrupt_requests", "False"]


def without_eos(reqs: list, eos_token_ids: tuple[int, ...]) -> list:
    """The requests for a server without `ignore_eos` (llama.cpp's): the end-of-sequence
    tokens banned through `logit_bias` instead, so every answer runs to max_tokens."""
    import dataclasses

    bias = {str(i): -100.0 for i in eos_token_ids}
    return [dataclasses.replace(r, body={**r.body, "logit_bias": bias}) for r in reqs]


class BaselineServer:
    """One OpenAI-compatible server as a child process in its own process group."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: str,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.port, self.log_path = name, argv, port, log_path
        self.env = env or {}
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, ready_timeout_s: float,
              progress: Callable[[str], None] = lambda what: None) -> "BaselineServer":
        """Start it and wait until `/v1/models` answers 200; RuntimeError with its log's tail
        if it exits or is not ready in time."""
        from pdserve.lifecycle import child_env

        log = open(self.log_path, "wb")
        with log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env=child_env({**os.environ, **self.env}))
        t0 = time.monotonic()
        while True:
            waited = time.monotonic() - t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} while "
                                   f"starting; its log ({self.log_path}) ends:\n{self.tail()}")
            if waited > ready_timeout_s:
                self.stop()
                raise RuntimeError(f"{self.name} not ready after {ready_timeout_s:.0f} s; its "
                                   f"log ({self.log_path}) ends:\n{self.tail()}")
            if self._models_ok():
                return self
            progress(f"starting {self.name} ({waited:.0f} s): {self.tail(1)[:90]}")
            time.sleep(1.0)

    def _models_ok(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", "/v1/models")
            return conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 8192))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join([x for x in text.splitlines() if x.strip()][-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to its process group, SIGKILL after `timeout_s`."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
