"""Builds a worker process: engine (loaded once), loop thread, both roles, gRPC server, and
(with `register_with`) the thread that registers it with its routers.

The store comes first: a store master of another cluster (`cluster_id`) ends the process with
exit code 1 before the weights load, naming both ids; a master that does not answer yet does
not stop the worker (it serves degraded until the store answers). The roles see the store
through a `GuardedStore`, whose health GetStats and /metrics report. Once the weights are loaded
and packed, the heap the loading freed (the checkpoint as read, the unpacked copies) goes back
to the operating system: about 450 MB of the default model's worker."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import sys

from pdserve import rpc
from pdserve.core.identity import WORKER
from pdserve.worker.decode.migrate import SHUTDOWN, Migrator
from pdserve.worker.decode.publish import PromptPublisher
from pdserve.worker.decode.role import DecodeRole
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from pdserve.engine.device import DeviceError, resolve_device
from pdserve.engine.engine_core import EngineCore
from pdserve.kvstore.client import KVStoreClient
from pdserve.kvstore.dist_client import ClusterRefused, DistStoreClient, DistStoreError
from pdserve.kvstore.retry import StoreRetryPolicy
from pdserve.worker.prefill.role import PrefillRole
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.worker.config import STEP_TOKENS, WorkerConfig
from pdserve.worker.cores import TURN_STEP_TOKENS, CoreLedger, StepThreads
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.guarded_store import GuardedStore
from pdserve.worker.registration import Registrar
from pdserve.worker.service import WorkerService
from pdserve.wire import role_to_proto

log = logging.getLogger(__name__)


def model_id_for(model_path: str, dtype: str, name: str | None = None,
                 quantization: str = "none", emulated: str = "") -> str:
    """The id KV keys carry: blocks of different weights, dtypes or quantizations never mix,
    nor an emulated engine's (`emulated`: its profile and KV scale) with any other."""
    base = name or os.path.basename(os.path.normpath(model_path))
    if emulated:
        return f"{base}@emulated:{emulated}"
    return f"{base}@{dtype}" + ("" if quantization == "none" else f"+{quantization}")


def step_token_budget(cfg: WorkerConfig) -> int:
    """The engine's per-step token budget for `cfg` (its device resolved, as `run` does): the
    configured one (0: the device's, `STEP_TOKENS`), but no more than TURN_STEP_TOKENS when the
    worker takes turns on a CPU host's cores with others (a step holds all of them, and the
    others wait it out)."""
    cpu = cfg.device == "cpu"
    budget = cfg.max_num_batched_tokens or STEP_TOKENS["cpu" if cpu else "accelerator"]
    if cfg.core_ledger and cfg.core_sharing == "turns" and cpu:
        return min(budget, TURN_STEP_TOKENS)
    return budget


def engine_config(cfg: WorkerConfig) -> EngineConfig:
    return EngineConfig(
        model_path=cfg.model_path, dtype=cfg.dtype, device=cfg.device,
        quantization=cfg.quantization,
        cache=CacheConfig(block_size_tokens=cfg.block_size_tokens, num_blocks=cfg.num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                                  max_num_batched_tokens=step_token_budget(cfg),
                                  max_waiting=cfg.max_waiting),
        spec=SpecConfig(method=cfg.spec_method,
                        num_speculative_tokens=cfg.num_speculative_tokens,
                        draft_path=cfg.draft_path or None, schedule=cfg.spec_schedule)
        if cfg.spec_method else None)


def build_engine(cfg: WorkerConfig) -> EngineCore:
    if cfg.emulated:  # no torch, no weights: the step-time profile's engine
        from pdserve.core.step_profile import load_profile
        from pdserve.engine.emulated import emulated_engine
        return emulated_engine(engine_config(cfg), load_profile(cfg.profile), cfg.kv_scale)
    from pdserve.engine.engine import LLMEngine
    engine = LLMEngine(engine_config(cfg))
    release_free_heap()
    engine.runner.guides.warm()  # structured outputs' vocabulary, off the engine thread
    return engine


def lent_threads(cfg: WorkerConfig, engine: EngineCore) -> StepThreads | None:
    """The engine thread's share of the host's cores (`worker/cores.py`), when the worker was
    given a ledger and computes on the CPU; None otherwise (threads fixed)."""
    if not cfg.core_ledger or engine.cfg.device != "cpu" or cfg.emulated:
        return None
    import torch
    cores = len(os.sched_getaffinity(0))
    own = min(cfg.threads, cores)
    most = max(own, min(cfg.max_threads or cfg.threads, cores))
    return StepThreads(CoreLedger(cfg.core_ledger), own, most, cores, torch.set_num_threads,
                       turns=cfg.core_sharing == "turns")


def release_free_heap() -> None:
    """Return the C heap's free pages to the OS (glibc's malloc_trim): freed memory otherwise
    stays in the process's resident set. Elsewhere a no-op."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def connect_store(cfg: WorkerConfig):
    retry = StoreRetryPolicy(budget_s=cfg.store_retry_budget_s)
    if cfg.store_kind == "simple":
        return KVStoreClient(cfg.store_address, retry=retry)
    return DistStoreClient(cfg.store_address, host_id=cfg.host_id,
                           default_replicas=cfg.store_replicas, cluster_id=cfg.cluster_id,
                           retry=retry)


def store_refusal(store) -> str | None:
    """Why the store's master refuses this worker (another cluster), or None: it accepts it,
    it cannot say now (not answering yet), or the store has no master (the simple store)."""
    if not isinstance(store, DistStoreClient):
        return None
    try:
        store.check_cluster()
    except ClusterRefused as e:
        return str(e)
    except DistStoreError as e:
        log.warning("the store master does not answer yet (%s); serving without the store "
                    "until it does", e)
    return None


def run(cfg: WorkerConfig, health_address: str | None = None) -> int:
    rpc.catch_stop_signals()  # a SIGTERM while the weights load still shuts down cleanly
    try:  # before anything starts: `--device cuda` on a host without CUDA is a one-line error
        cfg = dataclasses.replace(cfg, device="cpu" if cfg.emulated
                                  else resolve_device(cfg.device))
    except DeviceError as e:
        print(f"pdserve.worker: {e}", file=sys.stderr, flush=True)
        return 2
    raw_store = connect_store(cfg)
    refusal = store_refusal(raw_store)
    if refusal is not None:
        print(f"pdserve.worker: refused by the store master: {refusal}", file=sys.stderr,
              flush=True)
        raw_store.close()
        return 1
    store = GuardedStore(raw_store).start()
    if cfg.threads and not cfg.emulated:
        import torch
        torch.set_num_threads(cfg.threads)
    engine = build_engine(cfg)
    loop = EngineLoop(engine, threads=lent_threads(cfg, engine)).start()
    # The dtype the engine resolved (auto: by device): KV of different dtypes never mixes.
    model_id = model_id_for(cfg.model_path, engine.cfg.dtype, cfg.model_name, cfg.quantization,
                            emulated=f"{cfg.profile}/{cfg.kv_scale:g}" if cfg.emulated else "")
    role = role_to_proto(cfg.role)
    sender = None
    if cfg.progressive_kv:
        from pdserve.worker.prefill.kv_sender import KvStreamSender
        sender = KvStreamSender(engine, store, cfg.progressive_queue_bytes).start()
    publisher = PromptPublisher(loop, store, model_id)
    service = WorkerService(loop, PrefillRole(loop, store, model_id, sender=sender),
                            DecodeRole(loop, store, stream_wait_s=cfg.progressive_wait_ms / 1000,
                                       publisher=publisher, model_id=model_id),
                            role, model_id, migrator=Migrator(loop, store, model_id))
    server = rpc.make_server(cfg.rpc_threads, maximum_concurrent_rpcs=cfg.max_concurrent_rpcs)
    rpc.add_servicer(server, pb_grpc.add_WorkerServicer_to_server, service, rpc.Guard(WORKER))
    health = rpc.add_health_and_reflection(server, ["pdserve.v1.Worker"])
    metrics_note, metrics_server = "", None
    if cfg.metrics_port >= 0:
        from pdserve.metrics import WorkerCollector, serve_worker
        from pdserve.worker.metrics import StoreHealthCollector, WorkerCollectors

        host = cfg.address.rpartition(":")[0].strip("[]")
        metrics_server, port = serve_worker(
            WorkerCollectors(WorkerCollector(model_id, service.metrics_snapshot),
                             StoreHealthCollector(model_id, service.metrics_snapshot)),
            host, cfg.metrics_port)
        metrics_note = f" metrics=http://{host}:{port}/metrics"
    # The cluster's membership table: with a master, and an address others can be told.
    masters = (cfg.store_address if cfg.join_cluster and cfg.store_kind == "distributed"
               and cfg.address.rpartition(":")[2] != "0" else "")
    registrar = (Registrar(cfg.routers(), cfg.advertised(), cfg.local_address(),
                           lambda: service.role, masters=masters, cluster_id=cfg.cluster_id
                           ).start() if cfg.register_with or masters else None)
    code = rpc.run_until_signal(
        server, health, cfg.address,
        lambda where: f"pdserve.worker ready on {where} role={cfg.role} model={model_id}"
                      f" device={engine.cfg.device}"
                      f"{metrics_note}", WORKER, health_address=health_address,
        # Stopped (SIGTERM: a scale-down, a rollout): the decodes running here move on with
        # their KV before the server stops.
        on_stop=lambda: service.move_running(SHUTDOWN))
    if registrar is not None:
        registrar.stop()
    if metrics_server is not None:
        metrics_server.shutdown()
    loop.stop()
    if loop.threads is not None:
        loop.threads.ledger.close()
    if sender is not None:
        sender.stop()
    publisher.close()
    store.close()
    return code
