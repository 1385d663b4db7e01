"""The router's gRPC service: Generate (prefill on one pool, decode on the other) and ListModels.

Owns a request's trip through the cluster: validate and tokenize, pick a prefill worker, send the
first token to the client as soon as it exists (that is TTFT), hand the KV handle to a decode
worker, relay its tokens as final text deltas, and stop the decode when a stop string appears or
the client goes away; before all that, the door: the tenant from the API key (`auth`), admission
against the in-flight and rate bounds (`admission`: RESOURCE_EXHAUSTED with a `retry-after`
trailer), and the request metrics (`pdserve.metrics`). Must not run the model.
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from pdserve.engine.sampling import InvalidArgumentError
from pdserve.logctx import request_context
from pdserve.metrics import RouterMetrics
from pdserve.router.admission import Admission, Overloaded
from pdserve.router.auth import ApiKeys, AuthError
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.proto import worker_pb2 as wpb
from pdserve.router.policy import LeastLoaded, NoWorkerError, RoundRobin
from pdserve.router.pool import WorkerPool  # noqa: F401  (re-exported: built by server.py)
from pdserve.router.text import OutputText
from pdserve.router.validate import check_model, prompt_ids_of, sampling_of
from pdserve.wire import finish_from_proto, finish_to_proto, params_to_proto

log = logging.getLogger(__name__)


class RouterService(api_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer, model_config, model_names: tuple[str, ...], max_model_len: int,
                 prefill: WorkerPool, decode: WorkerPool, timeout_s: float = 600.0,
                 admission: Admission | None = None, api_keys: ApiKeys | None = None,
                 metrics: RouterMetrics | None = None) -> None:
        self.admission = admission or Admission()
        self.api_keys = api_keys or ApiKeys({})
        self.metrics = metrics or RouterMetrics(model_names[0] if model_names else "")
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.model_names = model_names
        self.max_model_len = max_model_len
        self.prefill = prefill
        self.decode = decode
        self.timeout_s = timeout_s

    @staticmethod
    def default_pools(prefill: tuple[str, ...], decode: tuple[str, ...]):
        return WorkerPool(prefill, RoundRobin()), WorkerPool(decode, LeastLoaded())

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
        m, last, finish = self.metrics, None, None
        m.waiting.inc()
        state = {"waiting": True}
        try:
            with request_context(rid):
                for resp in self._generate(request, context, rid, tenant, arrival, state):
                    now = time.monotonic()
                    if resp.token_ids:
                        if last is None:
                            m.ttft.observe(now - arrival)
                        else:
                            gap = (now - last) / len(resp.token_ids)
                            for _ in resp.token_ids:
                                m.itl.observe(gap)
                        last = now
                    if resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        finish = finish_from_proto(resp.finish_reason)
                        u = resp.usage
                        m.e2e.observe(now - arrival)
                        m.prompt_tokens.inc(u.prompt_tokens)
                        m.generation_tokens.inc(u.completion_tokens)
                        m.prefix_queries.inc(u.prompt_tokens)
                        m.prefix_hits.inc(u.cached_prompt_tokens)
                        m.finished(finish)
                        log.info("finished: %s, %d prompt tokens (%d cached), %d generated, "
                                 "%.3f s", finish, u.prompt_tokens, u.cached_prompt_tokens,
                                 u.completion_tokens, now - arrival)
                    yield resp
        finally:
            (m.waiting if state["waiting"] else m.running).dec()
            if finish is None:
                m.finished("abort")
            self.admission.release(tenant)

    def _picked(self, arrival: float, state: dict) -> None:
        """A prefill worker took the request: it leaves the queue."""
        self.metrics.queue_time.observe(time.monotonic() - arrival)
        self.metrics.waiting.dec()
        self.metrics.running.inc()
        state["waiting"] = False

    def _generate(self, request, context, rid: str, tenant: str, arrival: float, state: dict):
        try:
            check_model(request.model, self.model_names)
            prompt_ids = prompt_ids_of(request, self.tokenizer, self.model_config.vocab_size)
            params = sampling_of(request, len(prompt_ids), self.max_model_len, self.model_config)
        except InvalidArgumentError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        sampling = params_to_proto(params)
        text = OutputText(self.tokenizer, prompt_ids, params.stop)
        try:
            with self.prefill.pick(prompt_ids, salt=tenant) as stub:
                self._picked(arrival, state)
                pre = stub.Prefill(wpb.PrefillRequest(request_id=rid, prompt_token_ids=prompt_ids,
                                                      sampling=sampling, tenant_salt=tenant),
                                   timeout=self._timeout(context))
        except grpc.RpcError as e:
            context.abort(e.code(), f"prefill: {e.details()}")
        except NoWorkerError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill: {e}")
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
        yield from self._decode(rid, context, prompt_ids, first, sampling, pre.kv, text, usage)

    def _decode(self, rid, context, prompt_ids, first, sampling, kv, text: OutputText, usage):
        finish = None
        try:
            with self.decode.pick(prompt_ids, extra_tokens=sampling.max_tokens) as stub:
                call = stub.Decode(wpb.DecodeRequest(request_id=rid, prompt_token_ids=prompt_ids,
                                                     first_token_id=first, sampling=sampling, kv=kv),
                                   timeout=self._timeout(context))
                # A client that cancels or disconnects cancels the decode: the worker frees the KV.
                if not context.add_callback(call.cancel):
                    call.cancel()  # the client left during prefill: the callback never runs
                for chunk in call:
                    usage.completion_tokens += len(chunk.token_ids)
                    delta = text.push(chunk.token_ids)
                    if text.stopped:
                        call.cancel()
                        finish = "stop"
                    elif chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        finish = finish_from_proto(chunk.finish_reason)
                    if finish is not None:
                        yield self._final(rid, delta + text.finish(), list(chunk.token_ids),
                                          finish, usage, chunk.logprobs)
                        return
                    if delta or chunk.token_ids:
                        yield api_pb2.GenerateResponse(request_id=rid, text=delta,
                                                       token_ids=list(chunk.token_ids),
                                                       logprobs=chunk.logprobs)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and not context.is_active():
                return  # the client left; nothing to send
            context.abort(e.code(), f"decode: {e.details()}")
        except NoWorkerError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"decode: {e}")
        context.abort(grpc.StatusCode.INTERNAL, "decode stream ended without a finish reason")

    @staticmethod
    def _final(rid, text, token_ids, finish, usage, logprobs=()):
        return api_pb2.GenerateResponse(request_id=rid, text=text, token_ids=token_ids,
                                        finish_reason=finish_to_proto(finish), usage=usage,
                                        logprobs=logprobs)
