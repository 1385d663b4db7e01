"""The worker's gRPC service: Prefill, Decode (and DecodeMany: many Decodes over one stream,
`worker/decode_mux.py`), Abort, SetRole (with drain), Migrate, GetStats, WatchKvEvents (the
prefix cache's changes, for KV-aware routing).

Owns request admission per role and the role switch: both roles are built once over the same
engine, so switching is a flag flip after in-flight requests drain, never a weight reload; a
decode worker's drain may move its running requests to other decode workers with their KV
instead (`SetRole.migrate`, `decode/migrate.py`), as its SIGTERM does (`move_running`); and
`Migrate` moves some of them, those with the most tokens left, keeping the role (the
controller's balance).
A decode request may ask to be prefilled here (`prefill_locally`): the decode role computes
its prompt in its own batches instead of reading KV from the store, and, for a request resumed
after another decode worker moved it or died (`resume_token_ids`), the tokens it had already
emitted, from the blocks of them the store holds where it can.
Maps engine errors to gRPC statuses (invalid argument, resource exhausted, failed precondition),
and the worker's own failures to statuses that say what happened, never an empty INTERNAL: an
engine too busy to take a request (`EngineBusy`) or a store that failed a call the request could
not do without is UNAVAILABLE (the router re-routes it), a prefill past its time
DEADLINE_EXCEEDED, a caller that left CANCELLED. Reports the store's degraded mode in GetStats.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import grpc

from pdserve.worker.decode.migrate import BALANCE, COPIED, DRAIN, Migrator
from pdserve.worker.decode.role import DecodeChunk, DecodeRole
from pdserve.logctx import request_context
from pdserve.engine.block_pool import REMOVED, STORED
from pdserve.core.sampling_params import InvalidArgumentError
from pdserve.engine.scheduler import QueueFullError
from pdserve.worker.prefill.role import PrefillCancelled, PrefillRole
from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.wire import (ROLE_OF_PROTO, finish_to_proto, logprobs_to_proto, params_from_proto,
                          role_from_proto)
from pdserve.worker import decode_mux
from pdserve.worker.engine_loop import EngineBusy, EngineLoop
from pdserve.worker.guarded_store import StoreFailure
from pdserve.worker.kv_stream import StreamHandle

log = logging.getLogger(__name__)
_KV_EVENT_KINDS = {STORED: pb.KV_EVENT_KIND_STORED, REMOVED: pb.KV_EVENT_KIND_REMOVED}
_KV_EVENT_BATCH_S = 0.02
_PROGRESSIVE_STATS = ("progressive_requests", "progressive_anchor_joins", "progressive_exact_joins",
                      "progressive_fallbacks", "anchor_num_drafts", "anchor_num_draft_tokens",
                      "anchor_num_accepted_tokens", "kv_stream_layers_put", "kv_stream_fallbacks",
                      "kv_stream_put_failures")
# What the controller measures a worker's speed and offload with (WorkerStats 31-37).
_CONTROLLER_STATS = ("prompt_tokens_computed", "busy_seconds", "decode_steps",
                     "decode_step_seconds", "local_prefill_requests", "local_prefill_tokens",
                     "draining")
_MIGRATE_REASONS = (BALANCE,)  # what a Migrate caller may name (its counter's reason)


class _Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, _Rejected):
        return e.code, str(e)
    if isinstance(e, InvalidArgumentError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; retry after 1s"
    if isinstance(e, (EngineBusy, StoreFailure)):
        return grpc.StatusCode.UNAVAILABLE, f"{e}; retry"
    if isinstance(e, PrefillCancelled):
        return grpc.StatusCode.CANCELLED, str(e)
    if isinstance(e, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(e) or f"{type(e).__name__}: timed out"
    log.exception("request failed", exc_info=e)
    return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(self, loop: EngineLoop, prefill: PrefillRole, decode: DecodeRole, role: int,
                 model_id: str, migrator: Migrator | None = None) -> None:
        self.loop = loop
        self.migrator = migrator  # moves running decodes off this worker with their KV
        self.prefill_role = prefill
        self.decode_role = decode
        self.role = role
        self.model_id = model_id
        self._cond = threading.Condition()
        self._inflight = 0
        self._accepting = True
        self.role_switches = 0
        self.requests_finished = 0
        self.weight_loads = 1  # the engine was built once, at start

    @contextmanager
    def _admit(self, role: int, request_id: str = ""):
        with self._cond:
            if role != self.role:
                raise _Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker is in the {role_from_proto(self.role)} role")
            if not self._accepting:
                raise _Rejected(grpc.StatusCode.UNAVAILABLE, "worker is draining for a role switch")
            self._inflight += 1
        try:
            with request_context(request_id):  # the router's id on this hop's log lines
                log.info("%s started", role_from_proto(role))
                yield
        finally:
            with self._cond:
                self._inflight -= 1
                self.requests_finished += 1
                self._cond.notify_all()

    def Prefill(self, request, context):
        try:
            with self._admit(pb.ROLE_PREFILL, request.request_id):
                res = self.prefill_role.prefill(
                    request.request_id, list(request.prompt_token_ids),
                    params_from_proto(request.sampling), request.tenant_salt,
                    context.is_active)
        except Exception as e:
            context.abort(*_status_of(e))
        kv = pb.KvHandle(model_id=self.model_id, tenant_salt=request.tenant_salt,
                         block_size_tokens=self.loop.engine.block_size, num_tokens=res.num_tokens,
                         block_hashes=res.block_hashes, keys=res.keys)
        if res.stream_id:
            assert res.spans
            kv.stream_id = res.stream_id
            kv.span_starts.extend(a for a, _ in res.spans)
            kv.span_ends.extend(b for _, b in res.spans)
            kv.num_layers = self.loop.engine.model_config.num_hidden_layers
            kv.kv_dtype = self.loop.engine.cfg.dtype
        resp = pb.PrefillResponse(request_id=request.request_id, first_token_id=res.first_token,
                                  finish_reason=finish_to_proto(res.finish_reason), kv=kv,
                                  num_cached_tokens=res.num_cached_tokens)
        if res.first_logprobs is not None:
            resp.first_logprobs.CopyFrom(logprobs_to_proto(res.first_logprobs))
        resp.prompt_logprobs.extend(logprobs_to_proto(lp) for lp in res.prompt_logprobs or ())
        return resp

    def Decode(self, request, context):
        try:
            yield from self._decode_responses(request, context)
        except Exception as e:
            context.abort(*_status_of(e))

    def DecodeMany(self, request_iterator, context):
        return decode_mux.serve(request_iterator, context, self._decode_responses, _status_of,
                                self.loop.wait_handed_off)

    def _decode_responses(self, request, context) -> Iterator[pb.DecodeResponse]:
        with self._admit(pb.ROLE_DECODE, request.request_id):
            for c in self._decode_chunks(request, context):
                yield pb.DecodeResponse(
                    token_ids=c.token_ids, finish_reason=finish_to_proto(c.finish_reason),
                    moved=c.moved,
                    logprobs=[logprobs_to_proto(lp) for lp in c.logprobs or ()],
                    made_unix_s=c.made_s,
                    prompt_logprobs=[logprobs_to_proto(lp) for lp in c.prompt_logprobs or ()])

    def _decode_chunks(self, request, context) -> Iterator[DecodeChunk]:
        params = params_from_proto(request.sampling)
        if request.prefill_locally:
            if request.prefill_chunk_tokens < 0:
                raise InvalidArgumentError("prefill_chunk_tokens", "must be >= 0 (0: no cap)")
            # Nothing of the KV handle is read but its tenant salt: the prompt is hashed with
            # it here, so tenants stay apart in this worker's prefix cache.
            return self.decode_role.decode_local(
                request.request_id, list(request.prompt_token_ids), params,
                request.kv.tenant_salt, request.prefill_chunk_tokens, context.is_active,
                list(request.resume_token_ids))
        if request.resume_token_ids:
            # Resumed tokens are recomputed here; a KV handle only covers a prompt.
            raise InvalidArgumentError("resume_token_ids", "needs prefill_locally")
        if request.kv.model_id and request.kv.model_id != self.model_id:
            raise _Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                            f"KV is for {request.kv.model_id}, this worker serves "
                            f"{self.model_id}")
        return self.decode_role.decode(
            request.request_id, list(request.prompt_token_ids), request.first_token_id, params,
            list(request.kv.block_hashes), list(request.kv.keys), request.kv.tenant_salt,
            context.is_active, self._stream_of(request))

    def _stream_of(self, request) -> StreamHandle | None:
        """The KvHandle's stream, checked against this worker's engine; None for a plain one."""
        kv = request.kv
        if not kv.stream_id:
            return None
        engine = self.loop.engine
        spans = tuple(zip(kv.span_starts, kv.span_ends))
        n = len(request.prompt_token_ids)
        ok = (spans and len(kv.span_starts) == len(kv.span_ends) and spans[-1][1] == n
              and spans[0][0] % engine.block_size == 0
              and all(a < b for a, b in spans)
              and all(p[1] == q[0] for p, q in zip(spans, spans[1:])))
        if not ok:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                            "kv.span_starts/span_ends: must be contiguous, block-aligned at the "
                            "start, and end at the prompt's end")
        if (kv.num_layers != engine.model_config.num_hidden_layers
                or kv.kv_dtype != engine.cfg.dtype
                or kv.block_size_tokens != engine.block_size):
            raise _Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                            f"kv: streamed as {kv.num_layers} layers of {kv.kv_dtype} in blocks of "
                            f"{kv.block_size_tokens}; this worker has "
                            f"{engine.model_config.num_hidden_layers} of {engine.cfg.dtype} in "
                            f"blocks of {engine.block_size}")
        return StreamHandle(kv.model_id or self.model_id, kv.stream_id, spans, kv.num_layers,
                            kv.kv_dtype)

    def Abort(self, request, context):
        try:
            found = self.loop.call(lambda: self.loop.engine.abort(request.request_id))
        except EngineBusy as e:
            context.abort(*_status_of(e))
        self.loop.close_stream(request.request_id)
        return pb.AbortResponse(found=found)

    def SetRole(self, request, context):
        if request.role not in ROLE_OF_PROTO:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role: must be ROLE_PREFILL or ROLE_DECODE")
        with self._cond:
            previous = self.role
            if request.role == previous:
                return pb.SetRoleResponse(previous_role=previous, role=previous)
            self._accepting = False
            drained = self._inflight
        moved = 0
        if request.drain and request.migrate and previous == pb.ROLE_DECODE:
            moved = len(self.move_running(DRAIN))
        with self._cond:
            if request.drain:
                timeout = request.drain_timeout_s or 60.0
                if not self._cond.wait_for(lambda: self._inflight == 0, timeout=timeout):
                    self._accepting = True
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"drain_timeout_s: {self._inflight} requests still running "
                                  f"after {timeout}s; role unchanged")
            self.role = request.role
            self.role_switches += 1
            self._accepting = True
        log.info("role switched from %s to %s", role_from_proto(previous),
                 role_from_proto(request.role))
        return pb.SetRoleResponse(previous_role=previous, role=request.role,
                                  drained_requests=drained, moved_requests=moved)

    def Migrate(self, request, context):
        if request.count < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "count: must be >= 1")
        reason = request.reason
        if reason not in _MIGRATE_REASONS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"reason: must be one of {', '.join(_MIGRATE_REASONS)}, got "
                          f"{request.reason!r}")
        with self._cond:
            if self.role != pb.ROLE_DECODE:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"worker is in the {role_from_proto(self.role)} role: only a "
                              f"decode worker's running decodes move")
            if not self._accepting:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              "worker is draining for a role switch: its running decodes move "
                              "or finish with the drain")
        if self.migrator is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "worker moves no decodes: it was "
                          "built without a store to move their KV through")
        try:
            moved = self.migrator.move(self.migrator.most_left(request.count), reason)
        except Exception as e:
            context.abort(*_status_of(e))
        return pb.MigrateResponse(moved_requests=len(moved),
                                  copied_requests=sum(m.outcome == COPIED for m in moved))

    def move_running(self, reason: str) -> list:
        """Move every decode running here to other decode workers with its KV (none without a
        migrator, or in the prefill role)."""
        if self.migrator is None or self.role != pb.ROLE_DECODE:
            return []
        return self.migrator.move(self.migrator.movable(), reason)

    def metrics_snapshot(self) -> dict:
        """Engine and role counters, one read for both GetStats and the Prometheus collector
        (pdserve.metrics)."""
        loop = self.loop

        def read():  # on the engine thread, so the step counters agree with the engine's
            lent = loop.threads
            return dict(loop.engine.stats(), busy_seconds=loop.busy_seconds,
                        borrowed_steps=lent.borrowed_steps if lent else 0,
                        cores_given_back=lent.given_back if lent else 0,
                        cores_taken_up=lent.taken_up if lent else 0,
                        core_wait_seconds=lent.waited_s if lent else 0.0,
                        decode_steps=loop.decode_steps,
                        decode_step_seconds=loop.decode_step_seconds,
                        decode_step_histogram=loop.decode_step_histogram.snapshot())

        s = loop.call(read)
        d, sender = self.decode_role, self.prefill_role.sender
        pub = d.publisher  # blocks put: a prefill's, and a prompt prefilled in the decode role
        s.update(kv_blocks_put=self.prefill_role.blocks_put + (pub.blocks_put if pub else 0),
                 kv_blocks_fetched=self.decode_role.blocks_fetched,
                 progressive_requests=d.progressive_requests,
                 progressive_anchor_joins=d.progressive_anchor_joins,
                 progressive_exact_joins=d.progressive_exact_joins,
                 progressive_fallbacks=d.progressive_fallbacks,
                 local_prefill_requests=d.local_prefill_requests,
                 local_prefill_tokens=d.local_prefill_tokens,
                 draining=self.draining,
                 kv_stream_layers_put=sender.layers_put if sender else 0,
                 kv_stream_fallbacks=sender.fallbacks if sender else 0,
                 kv_stream_put_failures=sender.put_failures if sender else 0,
                 reads_by_transport=dict(getattr(self.decode_role.store, "reads_by_transport",
                                                 {})),
                 kv_recomputed_requests=d.kv_recomputed_requests,
                 **(self.migrator.stats() if self.migrator is not None else
                    {"migrations": {}, "migration_bytes": 0}),
                 **self._store_health())
        return s

    def _store_health(self) -> dict:
        view = getattr(self.decode_role.store, "view", None)  # a GuardedStore
        if view is None:
            return dict(store_degraded=False, store_degraded_reason="", store_errors={})
        v = view()
        return dict(store_degraded=v.degraded, store_degraded_reason=v.reason,
                    store_errors=v.errors)

    def GetStats(self, request, context):
        s = self.metrics_snapshot()
        return pb.WorkerStats(
            role=self.role, model_id=self.model_id, num_running=s["num_running"],
            num_waiting=s["num_waiting"], num_free_blocks=s["num_free_blocks"],
            num_total_blocks=s["num_total_blocks"],
            prefix_cache_queries_tokens=s["prefix_cache_queries_tokens"],
            prefix_cache_hits_tokens=s["prefix_cache_hits_tokens"],
            kv_blocks_put=s["kv_blocks_put"], kv_blocks_fetched=s["kv_blocks_fetched"],
            kv_blocks_local_hits=self.decode_role.blocks_local,
            requests_finished=self.requests_finished, role_switches=self.role_switches,
            weight_loads=self.weight_loads,
            kv_blocks_from_store=self.prefill_role.blocks_from_store,
            kv_store_reads_by_transport=s["reads_by_transport"],
            spec_decode_num_drafts=s.get("spec_decode_num_drafts", 0),
            spec_decode_num_draft_tokens=s.get("spec_decode_num_draft_tokens", 0),
            spec_decode_num_accepted_tokens=s.get("spec_decode_num_accepted_tokens", 0),
            spec_decode_num_accepted_tokens_per_pos=s.get(
                "spec_decode_num_accepted_tokens_per_pos", []),
            **{k: s.get(k, 0) for k in _PROGRESSIVE_STATS},
            **{k: s[k] for k in _CONTROLLER_STATS},
            store_degraded=s["store_degraded"], store_degraded_reason=s["store_degraded_reason"],
            store_errors=s["store_errors"], kv_recomputed_requests=s["kv_recomputed_requests"],
            migrations=s["migrations"], migration_bytes=s["migration_bytes"],
            resumed_tokens_computed=self.decode_role.resumed_tokens_computed)

    @property
    def draining(self) -> bool:
        """A role switch is draining: new requests are refused with UNAVAILABLE."""
        return not self._accepting

    def WatchKvEvents(self, request, context):
        """A snapshot of the prefix cache, then its changes; a new snapshot after lost events.
        Reads the pool's event log from this RPC thread (it is locked); only the snapshot runs
        on the engine thread, so the snapshot and its sequence number agree."""
        pool = self.loop.engine.pool
        meta = dict(block_size_tokens=self.loop.engine.block_size, model_id=self.model_id)
        seq = None
        while context.is_active():
            if seq is None:
                seq, hashes = self.loop.call(lambda: (pool.events.last_seq, pool.cached_hashes()))
                yield pb.KvEventBatch(snapshot=True, seq=seq, events=[
                    pb.KvCacheEvent(kind=pb.KV_EVENT_KIND_STORED, block_hash=h) for h in hashes],
                    events_dropped=pool.events.dropped, **meta)
                continue
            if not pool.events.wait(seq, timeout_s=0.5):
                continue
            seen = time.time()
            time.sleep(_KV_EVENT_BATCH_S)  # let a step's events gather: fewer, larger messages
            events, lost = pool.events.since(seq)
            if lost:
                seq = None
                continue
            seq = events[-1].seq
            yield pb.KvEventBatch(seq=seq, events=[
                pb.KvCacheEvent(kind=_KV_EVENT_KINDS[e.kind], block_hash=e.block_hash)
                for e in events], events_dropped=pool.events.dropped, first_event_unix_s=seen,
                **meta)
