"""The router's gRPC service: Generate (prefill on one pool, decode on the other) and ListModels.

Owns a request's trip through the cluster: validate and tokenize, pick a prefill worker, send the
first token to the client as soon as it exists (that is TTFT), hand the KV handle to a decode
worker (on the one stream this router shares among its requests on that worker, `decode_mux.py`,
unless told to open a Decode call per request), relay its tokens as final text deltas, and stop the
decode when a stop string appears or the client goes away. A hop that a worker refuses or fails
(draining, switched role, queue full, dead) is re-routed to another worker of its pool as
`retry.RetryPolicy` allows, never once it has streamed tokens; a decode stream that breaks after it
has (the worker died) is resumed on another decode worker, which recomputes the prompt and every
token the client got (`DecodeRequest.resume_token_ids`) and streams the rest. A request the
controller's offload budgets allow is prefilled on a decode worker instead
(`DecodeRequest.prefill_locally`), falling back to the normal path if refused; so is one no prefill
worker can take, and one a decode worker caches all but a short tail of (`local_prefill.py`:
conditional disaggregation, on by default).
Before all that, the door: the tenant from the API key (`auth`), admission and the shutdown
gate (`lifecycle.Door`: in-flight, rate and predicted-TTFT bounds, RESOURCE_EXHAUSTED with a
`retry-after` trailer; UNAVAILABLE once the router is shutting down) and the request's metrics
and sample (`lifecycle.Trip`). A hop that fails for good ends with the status
`retry.client_status` gives (a worker's failure is UNAVAILABLE with a retry hint, never
INTERNAL). Must not run the model.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from pdserve.core import finish as fin
from pdserve.core.sampling_params import InvalidArgumentError
from pdserve.logctx import request_context
from pdserve.metrics import RouterMetrics
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.proto import worker_pb2 as wpb
from pdserve.router.admission import Admission
from pdserve.security.tenants import ApiKeys, AuthError
from pdserve.security import failures
from pdserve.router.control import RequestSignals
from pdserve.router.config import DECODE_STREAMS
from pdserve.router.decode_mux import DecodeMuxes
from pdserve.router.lifecycle import Door, Trip, abort_with_hint
from pdserve.router.membership import DECODE, PREFILL
from pdserve.router.policy import NoWorkerError
from pdserve.router.pool import WorkerSet
from pdserve.router.retry import RetryPolicy, client_status
from pdserve.router.text import OutputText
from pdserve.router.validate import check_model, prompt_ids_of, sampling_of
from pdserve.wire import finish_from_proto, finish_to_proto, params_to_proto

log = logging.getLogger(__name__)
_UNSET = common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class _Hop:
    relayed: bool = False  # this hop sent tokens to the client: it can no longer be retried


class RouterService(api_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer, model_config, model_names: tuple[str, ...], max_model_len: int,
                 workers: WorkerSet, timeout_s: float = 600.0,
                 admission: Admission | None = None, api_keys: ApiKeys | None = None,
                 metrics: RouterMetrics | None = None, retry: RetryPolicy | None = None,
                 signals: RequestSignals | None = None,
                 decode_streams: str = "shared", max_local_prefill_tokens: int = 0) -> None:
        if decode_streams not in DECODE_STREAMS:
            raise ValueError(f"decode_streams must be one of {DECODE_STREAMS}, "
                             f"got {decode_streams!r}")
        # "shared": one DecodeMany stream per decode worker; "per_request": a Decode call each.
        self.muxes = DecodeMuxes() if decode_streams == "shared" else None
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
        self.door = Door(self.admission, workers, self.metrics, self.signals)
        # A prompt a decode worker caches all but this many tokens of is prefilled there (0: off).
        self.max_local_prefill_tokens = max_local_prefill_tokens

    def ListModels(self, request, context):
        # One entry per model, as /v1/models: its aliases are accepted, not listed.
        return api_pb2.ListModelsResponse(models=[api_pb2.ModelInfo(
            id=self.model_names[0], max_context_length_tokens=self.max_model_len)])

    def _timeout(self, context) -> float:
        remaining = context.time_remaining()
        return self.timeout_s if remaining is None else max(0.001, min(remaining, self.timeout_s))

    def _tenant(self, request, context) -> str:
        auth = dict(context.invocation_metadata() or ()).get("authorization")
        try:
            return self.api_keys.tenant_of(auth, request.cache_salt)
        except AuthError as e:
            self.metrics.rejected("unauthenticated")
            failures.record("pdserve.v1.Generation", e.reason)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))

    def Generate(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        arrival = time.monotonic()
        trip = self.door.enter(self._tenant(request, context), context, arrival)
        try:
            with request_context(rid):
                for resp in self._generate(request, context, rid, trip):
                    self.door.sent(trip, resp)
                    yield resp
        finally:
            self.door.leave(trip)

    @staticmethod
    def _abort(context, trip: Trip, code: grpc.StatusCode, message: str):
        trip.error = code.name
        abort_with_hint(context, code, message)

    def _failed(self, context, trip: Trip, e: grpc.RpcError, hop: str):
        """A hop gave up after `e` from a worker: the client gets `client_status` of it."""
        code = getattr(grpc.StatusCode, client_status(e.code().name))
        self._abort(context, trip, code, f"{hop}: {e.details()}")

    def _retry(self, context, trip: Trip, hop: str, attempt: int, address: str,
               e: grpc.RpcError, streamed: bool) -> bool:
        """Whether to re-route after `e`; counts the retry and waits its backoff if so."""
        self.door.stopping(context)  # past the shutdown deadline: no retry, a clear status
        code = e.code()
        d = self.retry.decide(attempt, code.name, context.time_remaining(), streamed)
        if not d.retry or not context.is_active():
            return False
        log.info("%s on %s: %s %s; re-routing (%s)", hop, address, code.name, e.details(),
                 d.reason)
        self._count_retry(trip, hop, code.name, d.delay_s)
        return True

    def _count_retry(self, trip: Trip, hop: str, code: str, delay_s: float = 0.0) -> None:
        """One more hop for this request: in the metrics, the signals and its sample; then the
        backoff."""
        self.metrics.retried(hop, code)
        self.signals.retried()
        trip.retries += 1
        if delay_s > 0:
            time.sleep(delay_s)

    def _resume(self, context, trip: Trip, address: str, e: grpc.RpcError) -> bool:
        """Whether to resume a decode stream that broke after relaying tokens; counts the
        resume and waits its backoff if so."""
        self.door.stopping(context)
        code = e.code()
        d = self.retry.decide_resume(trip.resumes, code.name, context.time_remaining(),
                                     not context.is_active())
        if not d.retry:
            return False
        log.warning("decode on %s broke after %d tokens: %s %s; resuming on another decode "
                    "worker (%s)", address, len(trip.emitted), code.name, e.details(), d.reason)
        trip.resumes += 1
        self._count_retry(trip, "resume", code.name, d.delay_s)
        return True

    def _fallback(self, context, trip: Trip, code: grpc.StatusCode | None, message: str):
        """The prefill hop gave up: None (a decode worker prefills the prompt itself) when the
        rule allows, else the client gets the status."""
        self.door.stopping(context)
        name = None if code is None else code.name
        if not context.is_active() or not self.retry.prefill_fallback(name):
            code = getattr(grpc.StatusCode, client_status(name or "UNAVAILABLE"))
            self._abort(context, trip, code, message)
        log.warning("%s; prefilling on a decode worker instead", message)
        self._count_retry(trip, "prefill_fallback", name or "UNAVAILABLE")
        return None

    @staticmethod
    def _local_request(rid: str, prompt_ids, sampling, trip: Trip, chunk_tokens: int = 0
                       ) -> wpb.DecodeRequest:
        """A decode that prefills on its worker: the prompt, then (resuming) every token the
        client already got. Only the tenant's salt of a KV handle: prompts hash apart."""
        return wpb.DecodeRequest(request_id=rid, prompt_token_ids=prompt_ids, sampling=sampling,
                                 prefill_locally=True, prefill_chunk_tokens=chunk_tokens,
                                 resume_token_ids=trip.emitted,
                                 kv=wpb.KvHandle(tenant_salt=trip.tenant))

    def _generate(self, request, context, rid: str, trip: Trip):
        try:
            check_model(request.model, self.model_names)
            prompt_ids = prompt_ids_of(request, self.tokenizer, self.model_config.vocab_size,
                                       self.max_model_len)
            params = sampling_of(request, len(prompt_ids), self.max_model_len, self.model_config)
        except InvalidArgumentError as e:
            self._abort(context, trip, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        trip.prompt_tokens = len(prompt_ids)
        self.door.admit_prefill(trip, prompt_ids, context)
        sampling = params_to_proto(params)
        text = OutputText(self.tokenizer, prompt_ids, params.stop)
        if (yield from self._cached_local(context, rid, prompt_ids, sampling, text, trip)):
            return
        if (yield from self._offload(context, rid, prompt_ids, sampling, text, trip)):
            return
        pre = self._prefill(context, rid, prompt_ids, sampling, trip)
        if pre is None:  # no prefill worker could take it: a decode worker prefills it
            usage = api_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=0,
                                  cached_prompt_tokens=0)
            req = self._local_request(rid, prompt_ids, sampling, trip)
            yield from self._decode(context, req, text, usage, trip)
            return
        usage = api_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=1,
                              cached_prompt_tokens=pre.num_cached_tokens)
        first = pre.first_token_id
        first_lps = [pre.first_logprobs] if pre.HasField("first_logprobs") else []
        delta = text.push([first])
        finish = fin.STOP if text.stopped else finish_from_proto(pre.finish_reason)
        if finish is not None:
            yield self._final(rid, delta + text.finish(), [first], finish, usage, first_lps)
            return
        trip.emitted.append(first)
        yield api_pb2.GenerateResponse(request_id=rid, text=delta, token_ids=[first],
                                       logprobs=first_lps)
        req = wpb.DecodeRequest(request_id=rid, prompt_token_ids=prompt_ids, first_token_id=first,
                                sampling=sampling, kv=pre.kv)
        yield from self._decode(context, req, text, usage, trip)

    def _prefill(self, context, rid, prompt_ids, sampling, trip: Trip):
        """The prefill hop, re-routed to another prefill worker while the policy allows; None
        when none could take it and a decode worker is to prefill it (`_fallback`)."""
        req = wpb.PrefillRequest(request_id=rid, prompt_token_ids=prompt_ids, sampling=sampling,
                                 tenant_salt=trip.tenant)
        failed: set[str] = set()
        attempt = 0
        while True:
            try:
                with self.workers.pick(PREFILL, prompt_ids, salt=trip.tenant,
                                       exclude=frozenset(failed)) as (address, stub):
                    self.door.picked(trip)
                    attempt += 1
                    call = stub.Prefill.future(req, timeout=self._timeout(context))
                    return self.door.result(call, context)
            except NoWorkerError as e:
                if failed:  # every active worker failed once: they may serve a moment later
                    failed.clear()
                    continue
                return self._fallback(context, trip, None, f"prefill: {e}")
            except grpc.RpcError as e:
                if not self._retry(context, trip, "prefill", attempt, address, e, False):
                    return self._fallback(context, trip, e.code(), f"prefill: {e.details()}")
                failed.add(address)

    def _decode(self, context, req: wpb.DecodeRequest, text: OutputText, usage, trip: Trip,
                dead: frozenset[str] = frozenset()):
        """The decode hop. While it relayed nothing it is re-routed as it is: a KV handle stays
        valid (the blocks are in the store), and seeded sampling makes the new worker's tokens
        the ones the first would have sent. Once it relayed tokens (or when its status may not
        be retried), a break resumes it on another decode worker (`_local_request` with every
        token sent), and the worker that broke is left out for the rest of the request."""
        refused: set[str] = set()
        attempt = 0
        while True:
            hop = _Hop()
            try:
                with self.workers.pick(DECODE, req.prompt_token_ids,
                                       extra_tokens=req.sampling.max_tokens,
                                       exclude=frozenset(refused) | dead) as (address, stub):
                    self.door.picked(trip)
                    attempt += 1
                    call = self._decode_call(address, stub, req, context)
                    if (yield from self._relay(context, req.request_id, call, text, usage, hop,
                                               trip)):
                        return
                # The worker's stream ended early: its failure, not the request's.
                self._abort(context, trip, grpc.StatusCode.UNAVAILABLE,
                            "decode stream ended without a finish reason")
            except NoWorkerError as e:
                if refused:  # each refused once: they may serve a moment later; dead stay out
                    refused.clear()
                    continue
                self._abort(context, trip, grpc.StatusCode.UNAVAILABLE, f"decode: {e}")
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED and not context.is_active():
                    return  # the client left; nothing to send
                if not hop.relayed and self._retry(context, trip, "decode", attempt, address,
                                                   e, False):
                    refused.add(address)
                    continue
                if not self._resume(context, trip, address, e):
                    self._failed(context, trip, e, "decode")
                dead |= {address}
                req = self._local_request(req.request_id, req.prompt_token_ids, req.sampling,
                                          trip)
                refused.clear()
                attempt = 0  # a resumed hop gets its own attempts

    def _offload(self, context, rid, prompt_ids, sampling, text: OutputText, trip: Trip):
        """Prefill and decode on one decode worker, when the controller's budgets allow it;
        True when the request was served so (or the client left, or it was resumed elsewhere
        after its worker broke), False to take the normal path (no budget fits, or the worker
        refused before sending a token)."""
        usage = api_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=0,
                              cached_prompt_tokens=0)
        with self.workers.offload(len(prompt_ids)) as chosen:
            if chosen is None:
                return False
            address, stub, chunk = chosen
            served = yield from self._local(context, rid, prompt_ids, sampling, text, usage,
                                            trip, address, stub, chunk, "offload")
        return (yield from self._local_resumed(context, rid, prompt_ids, sampling, text, usage,
                                               trip, address, served))

    def _cached_local(self, context, rid, prompt_ids, sampling, text: OutputText, trip: Trip):
        """Prefill and decode on the decode worker that caches all but a short tail of the
        prompt (`local_prefill.py`); True when served so (as `_offload`), False to take the
        other paths."""
        with self.workers.cached_local(prompt_ids, trip.tenant, self.max_local_prefill_tokens,
                                       sampling.max_tokens) as chosen:
            if chosen is None:
                return False
            address, stub, choice = chosen
            # What the router's index says the worker holds: the worker computes the rest.
            usage = api_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=0,
                                  cached_prompt_tokens=choice.cached_tokens)
            served = yield from self._local(context, rid, prompt_ids, sampling, text, usage,
                                            trip, address, stub, 0, "local_prefill")
        return (yield from self._local_resumed(context, rid, prompt_ids, sampling, text, usage,
                                               trip, address, served))

    def _local(self, context, rid, prompt_ids, sampling, text: OutputText, usage, trip: Trip,
               address: str, stub, chunk: int, what: str):
        """The request on `address`, which prefills it itself (`chunk` tokens a step at most,
        0: its step budget): True when served (or the client left), False when refused before
        a token (take the normal path), None when its stream broke after some and it is to be
        resumed elsewhere (after the caller's lease ends: it holds only while this worker
        serves the request). An offload counts as offloaded work for the controller."""
        self.door.picked(trip)
        req = self._local_request(rid, prompt_ids, sampling, trip, chunk)
        hop = _Hop()
        trip.offloaded = what == "offload"
        try:
            call = self._decode_call(address, stub, req, context)
            if (yield from self._relay(context, rid, call, text, usage, hop, trip)):
                return True
            self._abort(context, trip, grpc.StatusCode.UNAVAILABLE,
                        f"{what}: decode stream ended without a finish reason")
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and not context.is_active():
                return True
            if not hop.relayed and self._retry(context, trip, what, 1, address, e, False):
                trip.offloaded = False
                return False
            if not self._resume(context, trip, address, e):
                self._failed(context, trip, e, what)
        return None

    def _local_resumed(self, context, rid, prompt_ids, sampling, text: OutputText, usage,
                       trip: Trip, address: str, served: bool | None):
        """`served` as `_local` said; None: resume on another decode worker, then True."""
        if served is not None:
            return served
        req = self._local_request(rid, prompt_ids, sampling, trip)
        yield from self._decode(context, req, text, usage, trip, dead=frozenset({address}))
        return True
        return True

    def _decode_call(self, address: str, stub, req: wpb.DecodeRequest, context):
        """Start a decode hop: on the worker's shared stream, or a Decode call of its own."""
        if self.muxes is None:
            return stub.Decode(req, timeout=self._timeout(context))
        return self.muxes.start(address, stub, req, self._timeout(context))

    def _relay(self, context, rid: str, call, text: OutputText, usage, hop: _Hop, trip: Trip):
        """Relay one decode stream as text deltas; True once it ended with a finish reason
        (or a stop string cut it short), False if the stream ended without one. Every token
        relayed is added to `trip.emitted`."""
        # A client that cancels or disconnects cancels the decode: the worker frees the KV.
        if not context.add_callback(call.cancel):
            call.cancel()  # the client already left: the callback never runs
        with self.door.worker_call(call):
            try:
                for chunk in call:
                    if chunk.made_unix_s > 0:
                        self.metrics.worker_hop.observe(max(0.0, time.time() - chunk.made_unix_s))
                    usage.completion_tokens += len(chunk.token_ids)
                    trip.emitted.extend(chunk.token_ids)
                    delta = text.push(chunk.token_ids)
                    finish = None
                    if text.stopped:
                        call.cancel()
                        finish = fin.STOP
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
            finally:
                # Ended: a no-op. Left early (the relay closed, an error here): the worker
                # stops decoding for nobody.
                call.cancel()
        return False

    @staticmethod
    def _final(rid, text, token_ids, finish, usage, logprobs=()):
        return api_pb2.GenerateResponse(request_id=rid, text=text, token_ids=token_ids,
                                        finish_reason=finish_to_proto(finish), usage=usage,
                                        logprobs=logprobs)
