"""The router's gRPC service: Generate (prefill on one pool, decode on the other) and ListModels.

Owns a request's trip through the cluster: validate and tokenize, pick a prefill worker, send the
first token to the client as soon as it exists (that is TTFT), hand the KV handle to a decode
worker, relay its tokens as final text deltas, and stop the decode when a stop string appears or
the client goes away. A hop that a worker refuses or fails (draining, switched role, queue full,
dead) is re-routed to another worker of its pool as `retry.RetryPolicy` allows, never once it has
streamed tokens; a request the controller's offload budgets allow is prefilled on a decode
worker instead (`DecodeRequest.prefill_locally`), falling back to the normal path if refused.
Before all that, the door: the tenant from the API key (`auth`), admission against the in-flight
and rate bounds (`admission`: RESOURCE_EXHAUSTED with a `retry-after` trailer), and the request
metrics (`pdserve.metrics`) and samples (`control.RequestSignals`). Must not run the model.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from pdserve.engine.sampling import InvalidArgumentError
from pdserve.logctx import request_context
from pdserve.metrics import RouterMetrics
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.proto import worker_pb2 as wpb
from pdserve.router.admission import Admission, Overloaded
from pdserve.router.auth import ApiKeys, AuthError
from pdserve.router.control import RequestSignals, Sample, tpot_of
from pdserve.router.membership import DECODE, PREFILL
from pdserve.router.policy import NoWorkerError
from pdserve.router.pool import WorkerSet
from pdserve.router.retry import RetryPolicy
from pdserve.router.text import OutputText
from pdserve.router.validate import check_model, prompt_ids_of, sampling_of
from pdserve.wire import finish_from_proto, finish_to_proto, params_to_proto

log = logging.getLogger(__name__)
_UNSET = common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class _Trip:
    """One request's path, for its metrics and its sample."""

    arrival: float
    waiting: bool = True  # no prefill worker took it yet
    prompt_tokens: int = 0
    retries: int = 0
    offloaded: bool = False
    error: str = ""  # the status name the client got, when it failed


@dataclass
class _Hop:
    relayed: bool = False  # this hop sent tokens to the client: it can no longer be retried


class RouterService(api_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer, model_config, model_names: tuple[str, ...], max_model_len: int,
                 workers: WorkerSet, timeout_s: float = 600.0,
                 admission: Admission | None = None, api_keys: ApiKeys | None = None,
                 metrics: RouterMetrics | None = None, retry: RetryPolicy | None = None,
                 signals: RequestSignals | None = None) -> None:
        self.admission = admission or Admission()
        self.api_keys = api_keys or ApiKeys({})
        self.metrics = metrics or RouterMetrics(model_names[0] if model_names else "")
        self.retry = retry or RetryPolicy()
        self.signals = signals or RequestSignals()
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.model_names = model_names
        self.max_model_len = max_model_len
        self.workers = workers
        self.timeout_s = timeout_s

    def ListModels(self, request, context):
        return api_pb2.ListModelsResponse(models=[
            api_pb2.ModelInfo(id=n, max_context_length_tokens=self.max_model_len)
            for n in self.model_names])

    def _timeout(self, context) -> float:
        remaining = context.time_remaining()
        return self.timeout_s if remaining is None else max(0.001, min(remaining, self.timeout_s))

    def _tenant(self, request, context) -> str:
        auth = dict(context.invocation_metadata() or ()).get("authorization")
        try:
            return self.api_keys.tenant_of(auth, request.cache_salt)
        except AuthError as e:
            self.metrics.rejected("unauthenticated")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))

    def Generate(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        arrival = time.monotonic()
        tenant = self._tenant(request, context)
        try:
            self.admission.admit(tenant, arrival)
        except Overloaded as e:
            self.metrics.rejected("overloaded")
            context.set_trailing_metadata((("retry-after", f"{e.retry_after_s:g}"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        m, first, last, finish, sent = self.metrics, None, None, None, 0
        m.waiting.inc()
        self.signals.started()
        trip = _Trip(arrival)
        try:
            with request_context(rid):
                for resp in self._generate(request, context, rid, tenant, trip):
                    now = time.monotonic()
                    if resp.token_ids:
                        sent += len(resp.token_ids)
                        if last is None:
                            first = now
                            m.ttft.observe(now - arrival)
                        else:
                            gap = (now - last) / len(resp.token_ids)
                            for _ in resp.token_ids:
                                m.itl.observe(gap)
                        last = now
                    if resp.finish_reason != _UNSET:
                        finish = finish_from_proto(resp.finish_reason)
                        u = resp.usage
                        m.e2e.observe(now - arrival)
                        m.prompt_tokens.inc(u.prompt_tokens)
                        m.generation_tokens.inc(u.completion_tokens)
                        m.prefix_queries.inc(u.prompt_tokens)
                        m.prefix_hits.inc(u.cached_prompt_tokens)
                        m.finished(finish)
                        log.info("finished: %s, %d prompt tokens (%d cached), %d generated, "
                                 "%.3f s%s%s", finish, u.prompt_tokens, u.cached_prompt_tokens,
                                 u.completion_tokens, now - arrival,
                                 ", offloaded" if trip.offloaded else "",
                                 f", {trip.retries} retries" if trip.retries else "")
                    yield resp
        finally:
            (m.waiting if trip.waiting else m.running).dec()
            if finish is None:
                m.finished("abort")
            end = time.monotonic()
            ttft = 0.0 if first is None else first - arrival
            if trip.offloaded:
                self.signals.offloaded(trip.prompt_tokens)
            self.signals.finished(Sample(
                end, ttft, tpot_of(end - arrival, ttft, sent), trip.prompt_tokens, sent,
                trip.offloaded, trip.retries, finish or trip.error or "abort"))
            self.admission.release(tenant)

    def _picked(self, trip: _Trip) -> None:
        """A worker took the request: it leaves the queue (counted once, at the first pick)."""
        if not trip.waiting:
            return
        self.metrics.queue_time.observe(time.monotonic() - trip.arrival)
        self.metrics.waiting.dec()
        self.metrics.running.inc()
        trip.waiting = False

    @staticmethod
    def _abort(context, trip: _Trip, code: grpc.StatusCode, message: str):
        trip.error = code.name
        context.abort(code, message)

    def _retry(self, context, trip: _Trip, hop: str, attempt: int, address: str,
               e: grpc.RpcError, streamed: bool) -> bool:
        """Whether to re-route after `e`; counts the retry and waits its backoff if so."""
        code = e.code()
        d = self.retry.decide(attempt, code.name, context.time_remaining(), streamed)
        if not d.retry or not context.is_active():
            return False
        log.info("%s on %s: %s %s; re-routing (%s)", hop, address, code.name, e.details(),
                 d.reason)
        self.metrics.retried(hop, code.name)
        self.signals.retried()
        trip.retries += 1
        time.sleep(d.delay_s)
        return True

    def _generate(self, request, context, rid: str, tenant: str, trip: _Trip):
        try:
            check_model(request.model, self.model_names)
            prompt_ids = prompt_ids_of(request, self.tokenizer, self.model_config.vocab_size)
            params = sampling_of(request, len(prompt_ids), self.max_model_len, self.model_config)
        except InvalidArgumentError as e:
            self._abort(context, trip, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        trip.prompt_tokens = len(prompt_ids)
        sampling = params_to_proto(params)
        text = OutputText(self.tokenizer, prompt_ids, params.stop)
        if (yield from self._offload(context, rid, prompt_ids, sampling, tenant, text, trip)):
            return
        pre = self._prefill(context, rid, prompt_ids, sampling, tenant, trip)
        usage = api_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=1,
                              cached_prompt_tokens=pre.num_cached_tokens)
        first = pre.first_token_id
        first_lps = [pre.first_logprobs] if pre.HasField("first_logprobs") else []
        delta = text.push([first])
        finish = "stop" if text.stopped else finish_from_proto(pre.finish_reason)
        if finish is not None:
            yield self._final(rid, delta + text.finish(), [first], finish, usage, first_lps)
            return
        yield api_pb2.GenerateResponse(request_id=rid, text=delta, token_ids=[first],
                                       logprobs=first_lps)
        req = wpb.DecodeRequest(request_id=rid, prompt_token_ids=prompt_ids, first_token_id=first,
                                sampling=sampling, kv=pre.kv)
        yield from self._decode(context, req, text, usage, trip)

    def _prefill(self, context, rid, prompt_ids, sampling, tenant: str, trip: _Trip):
        """The prefill hop, re-routed to another prefill worker while the policy allows."""
        req = wpb.PrefillRequest(request_id=rid, prompt_token_ids=prompt_ids, sampling=sampling,
                                 tenant_salt=tenant)
        failed: set[str] = set()
        attempt = 0
        while True:
            try:
                with self.workers.pick(PREFILL, prompt_ids, salt=tenant,
                                       exclude=frozenset(failed)) as (address, stub):
                    self._picked(trip)
                    attempt += 1
                    return stub.Prefill(req, timeout=self._timeout(context))
            except NoWorkerError as e:
                if failed:  # every active worker failed once: they may serve a moment later
                    failed.clear()
                    continue
                self._abort(context, trip, grpc.StatusCode.UNAVAILABLE, f"prefill: {e}")
            except grpc.RpcError as e:
                if not self._retry(context, trip, "prefill", attempt, address, e, False):
                    self._abort(context, trip, e.code(), f"prefill: {e.details()}")
                failed.add(address)

    def _decode(self, context, req: wpb.DecodeRequest, text: OutputText, usage, trip: _Trip):
        """The decode hop. Re-routed to another decode worker only while it relayed nothing:
        the KV handle stays valid (the blocks are in the store), and the seeded sampling makes
        the new worker's tokens the ones the first would have sent."""
        failed: set[str] = set()
        attempt = 0
        while True:
            hop = _Hop()
            try:
                with self.workers.pick(DECODE, req.prompt_token_ids,
                                       extra_tokens=req.sampling.max_tokens,
                                       exclude=frozenset(failed)) as (address, stub):
                    attempt += 1
                    call = stub.Decode(req, timeout=self._timeout(context))
                    if (yield from self._relay(context, req.request_id, call, text, usage, hop)):
                        return
                self._abort(context, trip, grpc.StatusCode.INTERNAL,
                            "decode stream ended without a finish reason")
            except NoWorkerError as e:
                if failed:
                    failed.clear()
                    continue
                self._abort(context, trip, grpc.StatusCode.UNAVAILABLE, f"decode: {e}")
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED and not context.is_active():
                    return  # the client left; nothing to send
                if not self._retry(context, trip, "decode", attempt, address, e, hop.relayed):
                    self._abort(context, trip, e.code(), f"decode: {e.details()}")
                failed.add(address)

    def _offload(self, context, rid, prompt_ids, sampling, tenant: str, text: OutputText,
                 trip: _Trip):
        """Prefill and decode on one decode worker, when the controller's budgets allow it;
        True when the request was served so (or the client left), False to take the normal
        path (no budget fits, or the worker refused before sending a token)."""
        with self.workers.offload(len(prompt_ids)) as chosen:
            if chosen is None:
                return False
            address, stub, chunk = chosen
            self._picked(trip)
            usage = api_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=0,
                                  cached_prompt_tokens=0)
            req = wpb.DecodeRequest(request_id=rid, prompt_token_ids=prompt_ids,
                                    sampling=sampling, prefill_locally=True,
                                    prefill_chunk_tokens=chunk,
                                    # The tenant's salt: its prompt hashes apart from others'.
                                    kv=wpb.KvHandle(tenant_salt=tenant))
            hop = _Hop()
            trip.offloaded = True
            try:
                call = stub.Decode(req, timeout=self._timeout(context))
                if (yield from self._relay(context, rid, call, text, usage, hop)):
                    return True
                self._abort(context, trip, grpc.StatusCode.INTERNAL,
                            "offload: decode stream ended without a finish reason")
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED and not context.is_active():
                    return True
                if not self._retry(context, trip, "offload", 1, address, e, hop.relayed):
                    self._abort(context, trip, e.code(), f"offload: {e.details()}")
                trip.offloaded = False
                return False

    def _relay(self, context, rid: str, call, text: OutputText, usage, hop: _Hop):
        """Relay one decode stream as text deltas; True once it ended with a finish reason
        (or a stop string cut it short), False if the stream ended without one."""
        # A client that cancels or disconnects cancels the decode: the worker frees the KV.
        if not context.add_callback(call.cancel):
            call.cancel()  # the client already left: the callback never runs
        for chunk in call:
            usage.completion_tokens += len(chunk.token_ids)
            delta = text.push(chunk.token_ids)
            finish = None
            if text.stopped:
                call.cancel()
                finish = "stop"
            elif chunk.finish_reason != _UNSET:
                finish = finish_from_proto(chunk.finish_reason)
            if finish is not None:
                hop.relayed = True
                yield self._final(rid, delta + text.finish(), list(chunk.token_ids), finish,
                                  usage, chunk.logprobs)
                return True
            if delta or chunk.token_ids:
                hop.relayed = True
                yield api_pb2.GenerateResponse(request_id=rid, text=delta,
                                               token_ids=list(chunk.token_ids),
                                               logprobs=chunk.logprobs)
        return False

    @staticmethod
    def _final(rid, text, token_ids, finish, usage, logprobs=()):
        return api_pb2.GenerateResponse(request_id=rid, text=text, token_ids=token_ids,
                                        finish_reason=finish_to_proto(finish), usage=usage,
                                        logprobs=logprobs)
