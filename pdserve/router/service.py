"""The router's gRPC service: Generate (prefill on one pool, decode on the other) and ListModels.

Owns a request's trip through the cluster: validate and tokenize, pick a prefill worker, send the
first token to the client as soon as it exists (that is TTFT), hand the KV handle to a decode
worker (on the one stream this router shares among its requests on that worker, `decode_mux.py`,
unless told to open a Decode call per request), relay its tokens as final text deltas, and stop the
decode when a stop string appears or the client goes away. A hop that a worker refuses or fails
(draining, switched role, queue full, dead) is re-routed to another worker of its pool as
`retry.RetryPolicy` allows, never once it has streamed tokens; a decode stream that breaks after it
has (the worker died) is resumed on another decode worker, which recomputes the prompt and every
token the client got (`DecodeRequest.resume_token_ids`) and streams the rest; so, at once and not
as a failure, is one its worker moved off with its KV (a `moved` message: that worker put the
blocks to the store, and the next one fetches them). A request the
controller's offload budgets allow is prefilled on a decode worker instead
(`DecodeRequest.prefill_locally`) when that gives it the lower estimated TTFT (the prefill
deflection, `deflect.py`), falling back to the normal path if refused; so is one no prefill
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

import functools
import logging
import secrets
import time
import uuid
from dataclasses import dataclass

import grpc

from pdserve.core import finish as fin
from pdserve.core.sampling_params import InvalidArgumentError
from pdserve.core.structured import Grammars
from pdserve.router import choices
from pdserve.router.choices import Leader
from pdserve.logctx import request_context
from pdserve.metrics import RouterMetrics
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.proto import worker_pb2 as wpb
from pdserve.router.admission import Admission
from pdserve.security.tenants import ApiKeys, AuthError
from pdserve.security import failures
from pdserve.router.control import RequestSignals
from pdserve.router.config import DECODE_STREAMS
from pdserve.router.decode_mux import DecodeMuxes, MuxCall
from pdserve.router.lifecycle import Door, Trip, abort_with_hint
from pdserve.core.roles import DECODE, PREFILL
from pdserve.router.policy import NoWorkerError
from pdserve.router.pool import LiveRequest, WorkerSet
from pdserve.router.retry import RetryPolicy, worker_message
from pdserve.router.route import (CACHED_LOCAL, DECODE_FALLBACK, DECODE_HOP, DISAGGREGATED,
                                  FALL_THROUGH, FALLBACK, GIVE_UP, LOCAL_HOP, OFFLOAD,
                                  PREFILL_HOP, RESUME, RETRY, Failure, Next, Route,
                                  after_failure, plan)
from pdserve.router.text import OutputText
from pdserve.router.validate import check_model, prompt_ids_of, sampling_of
from pdserve.wire import finish_from_proto, finish_to_proto, params_to_proto

log = logging.getLogger(__name__)
_UNSET = common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class _Hop:
    relayed: bool = False  # this hop sent tokens to the client: it can no longer be retried
    moved: bool = False  # its worker moved the request off with its KV: resume it elsewhere


def _call_failure(e: Exception, tracked, role: str, address: str) -> tuple[str, str]:
    """(status name, message) of a failed worker call: UNAVAILABLE with the router's reason
    when it ended the call itself (the worker stopped answering: re-routed like a dead one),
    else the worker's status in pdserve's words. A cancel the router did not make is raised."""
    if tracked is not None and tracked.why is not None:
        return "UNAVAILABLE", f"{role} worker {address} {tracked.why}"
    if not isinstance(e, grpc.RpcError):
        raise e
    return e.code().name, worker_message(e.code().name, e.details())


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
        self._grammars: Grammars | None = None

    def grammars(self) -> Grammars:
        """The structured outputs' grammars over this model's vocabulary, built on first use
        (a quarter of a second), then compiled once per constraint."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer.backend.to_str(), self.model_config.vocab_size,
                                      list(self.model_config.eos_token_ids))
        return self._grammars

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
        tenant = self._tenant(request, context)
        if request.n not in (0, 1) or request.best_of not in (0, 1):  # checked there
            yield from self._choices(request, context, rid, tenant)
            return
        yield from self._one(request, context, rid, tenant)

    def _one(self, request, context, rid: str, tenant: str, lead: Leader | None = None,
             follow: Leader | None = None):
        trip = self.door.enter(tenant, context, time.monotonic())
        trip.lead, trip.follow = lead, follow
        # The workers know the request by an id of its own: a client may reuse an id (even
        # while its last use still ends on a worker), and two clients may send the same one.
        wid = f"{rid}~{secrets.token_hex(4)}"
        scored = request.sampling.HasField("prompt_logprobs")  # its first message says the ids

        def out(resp):
            nonlocal scored
            resp.request_id = rid
            if scored:
                resp.prompt_token_ids.extend(trip.prompt_ids)
                scored = False
            self.door.sent(trip, resp)
            return resp

        emit = getattr(context, "emit", None)  # a call in this process (HTTP) takes them direct
        if emit is not None and lead is None and follow is None:
            trip.emit = lambda resp: emit(out(resp))
        try:
            with request_context(wid):
                for resp in self._generate(request, context, wid, trip):
                    yield out(resp)
        finally:
            self.door.leave(trip)
            if lead is not None:
                lead.publish(None)  # ended without a decode the others could share

    def _choices(self, request, context, rid: str, tenant: str):
        """n (or best_of) choices, each a request of its own, merged into one stream."""
        try:
            n, best_of = choices.check(request)
        except InvalidArgumentError as e:
            self.metrics.rejected("invalid_argument")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        reqs = choices.choice_requests(request, rid, best_of)
        leader = choices.Leader()
        streams = [functools.partial(self._one, r, context, r.request_id, tenant,
                                     leader if i == 0 else None, leader if i else None)
                   for i, r in enumerate(reqs)]
        yield from choices.serve(streams, rid, n, request.sampling.HasField("logprobs"))

    @staticmethod
    def _abort(context, trip: Trip, code: grpc.StatusCode, message: str):
        trip.error = code.name
        abort_with_hint(context, code, message)

    def _next(self, context, trip: Trip, failure: Failure, label: str, message: str) -> Next:
        """`route.after_failure`, carried out: past the shutdown deadline the client gets a
        clear status instead (`door.stopping`); a retry, fall-through, resume or fallback is
        logged, counted and waited for; a give-up aborts the call with the status it names
        (`message` says what failed), or, when the client left, returns for a quiet end."""
        self.door.stopping(context)
        n = after_failure(failure, self.retry)
        code = failure.code or "UNAVAILABLE"
        if n.action in (RETRY, FALL_THROUGH) and not n.clear_excluded:
            log.info("%s on %s: %s %s; re-routing (%s)", label, failure.address, code, message,
                     n.reason)
            self._count_retry(trip, label, code, n.delay_s)
        elif n.action == RESUME:
            log.warning("decode on %s broke after %d tokens: %s %s; resuming on another decode "
                        "worker (%s)", failure.address, len(trip.emitted), code, message,
                        n.reason)
            trip.resumes += 1
            self._count_retry(trip, "resume", code, n.delay_s)
        elif n.action == FALLBACK:
            log.warning("%s: %s; prefilling on a decode worker instead", label, message)
            self._count_retry(trip, "prefill_fallback", code)
        elif n.action == GIVE_UP and n.status is not None:
            self._abort(context, trip, getattr(grpc.StatusCode, n.status), f"{label}: {message}")
        return n

    def _failure(self, context, trip: Trip, hop: str, code: str | None, address: str = "",
                 attempt: int = 1, relayed: bool = False, excluded: bool = False) -> Failure:
        return Failure(hop, code, address, attempt, relayed, trip.resumes,
                       context.time_remaining(), not context.is_active(), excluded)

    def _count_retry(self, trip: Trip, hop: str, code: str, delay_s: float = 0.0) -> None:
        """One more hop for this request: in the metrics, the signals and its sample; then the
        backoff."""
        self.metrics.retried(hop, code)
        self.signals.retried()
        trip.retries += 1
        if delay_s > 0:
            time.sleep(delay_s)

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
            params = sampling_of(request, len(prompt_ids), self.max_model_len, self.model_config,
                                 self.grammars)
        except InvalidArgumentError as e:
            self._abort(context, trip, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        trip.prompt_tokens, trip.prompt_ids = len(prompt_ids), prompt_ids
        self.door.expect_output(trip, params.max_tokens)
        self.door.admit_prefill(trip, prompt_ids, context)
        sampling = params_to_proto(params)
        text = OutputText(self.tokenizer, prompt_ids, params.stop)
        if trip.follow is not None:  # another choice of a request: prefill where the first is
            address = trip.follow.wait(self._timeout(context))
            if address is not None and (yield from self._follow(
                    context, rid, prompt_ids, sampling, text, trip, address)):
                return
        want = LiveRequest(prompt_ids, trip.tenant, sampling.max_tokens)
        route = plan(self.workers, want, self.max_local_prefill_tokens)
        self.door.routed(trip, route)
        while route.kind in (CACHED_LOCAL, OFFLOAD):
            if (yield from self._local_path(context, rid, route, prompt_ids, sampling, text,
                                            trip)):
                return
            route = plan(self.workers, want, self.max_local_prefill_tokens, after=route.kind)
            self.door.routed(trip, route)
        if route.kind == DISAGGREGATED:
            pre = self._prefill(context, rid, route, want, sampling, trip)
        else:  # no prefill worker in the pool
            self._next(context, trip, self._failure(context, trip, PREFILL_HOP, None), "prefill",
                       f"no active {PREFILL} worker")
            pre = None
        if pre is None:  # no prefill worker could take it: a decode worker prefills it
            trip.path = DECODE_FALLBACK
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
            yield self._final(rid, delta + text.finish(), [first], finish, usage, first_lps,
                              pre.prompt_logprobs)
            return
        trip.emitted.append(first)
        yield api_pb2.GenerateResponse(request_id=rid, text=delta, token_ids=[first],
                                       logprobs=first_lps, prompt_logprobs=pre.prompt_logprobs)
        req = wpb.DecodeRequest(request_id=rid, prompt_token_ids=prompt_ids, first_token_id=first,
                                sampling=sampling, kv=pre.kv)
        yield from self._decode(context, req, text, usage, trip)

    def _prefill(self, context, rid, route: Route, want: LiveRequest, sampling, trip: Trip):
        """The prefill hop, first on the worker `route` took, re-routed to another prefill
        worker while the route allows; None when none could take it and a decode worker is to
        prefill it (FALLBACK)."""
        req = wpb.PrefillRequest(request_id=rid, prompt_token_ids=want.prompt_ids,
                                 sampling=sampling, tenant_salt=trip.tenant)
        failed: set[str] = set()
        attempt = 0
        taken: tuple[str, object] | None = (route.address, route.taken)
        while True:
            if taken is None:
                taken = self.workers.take_prefill(want, frozenset(failed))
            if taken is None:
                n = self._next(context, trip, self._failure(
                    context, trip, PREFILL_HOP, None, excluded=bool(failed)), "prefill",
                    f"no active {PREFILL} worker"
                    + (f" besides {sorted(failed)}" if failed else ""))
                if n.action == RETRY:  # every active worker failed once: they may serve now
                    failed.clear()
                    continue
                return None
            address, tracked = taken[0], None
            try:
                self.door.picked(trip)
                attempt += 1
                call = self.workers.stub(address).Prefill.future(
                    req, timeout=self._timeout(context))
                with self.workers.calls.tracking(
                        address, call, self.workers.first_answer_s(address)) as tracked:
                    return self.door.result(call, context)
            except (grpc.RpcError, grpc.FutureCancelledError) as e:
                code, message = _call_failure(e, tracked, PREFILL, address)
            finally:
                self.workers.release_taken(*taken)
                taken = None
            n = self._next(context, trip, self._failure(
                context, trip, PREFILL_HOP, code, address, attempt), "prefill", message)
            if n.action != RETRY:
                return None
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
            hop, tracked = _Hop(), None
            try:
                with self.workers.pick(DECODE, req.prompt_token_ids,
                                       extra_tokens=req.sampling.max_tokens,
                                       exclude=frozenset(refused) | dead) as (address, stub):
                    self.door.picked(trip)
                    attempt += 1
                    call = self._decode_call(address, stub, req, context)
                    with self.workers.calls.tracking(address, call) as tracked:
                        if (yield from self._relay(context, req.request_id, call, text, usage,
                                                   hop, trip, address)) and not hop.moved:
                            return
                if hop.moved:  # on with its KV, on another decode worker, at once
                    dead |= {address}
                    self._moved(trip, address)
                    req = self._local_request(req.request_id, req.prompt_token_ids, req.sampling,
                                              trip)
                    refused.clear()
                    attempt = 0
                    continue
                # The worker's stream ended early: its failure, not the request's.
                self._abort(context, trip, grpc.StatusCode.UNAVAILABLE,
                            "decode stream ended without a finish reason")
            except NoWorkerError as e:  # RETRY (each refused once), or GIVE_UP has aborted
                self._next(context, trip, self._failure(
                    context, trip, DECODE_HOP, None, excluded=bool(refused)), "decode", str(e))
                refused.clear()  # RETRY: each refused once, they may serve now; dead stay out
                continue
            except grpc.RpcError as e:
                code, message = _call_failure(e, tracked, DECODE, address)
                n = self._next(context, trip, self._failure(
                    context, trip, DECODE_HOP, code, address, attempt, hop.relayed),
                    "decode", message)
                if n.action == GIVE_UP:
                    return  # the client left; nothing to send
                if n.action == RETRY:
                    refused.add(address)
                    continue
                dead |= {address}  # RESUME
                req = self._local_request(req.request_id, req.prompt_token_ids, req.sampling,
                                          trip)
                refused.clear()
                attempt = 0  # a resumed hop gets its own attempts

    def _local_path(self, context, rid, route: Route, prompt_ids, sampling, text: OutputText,
                    trip: Trip):
        """Prefill and decode on the decode worker `route` took (CACHED_LOCAL: it caches all
        but a short tail of the prompt, `local_prefill.py`; OFFLOAD: within the controller's
        budget); True when the request was served so (or the client left, or it was resumed
        elsewhere after its worker broke), False to plan on (refused before a token)."""
        what = "offload" if route.kind == OFFLOAD else "local_prefill"
        # What the router's index says the worker holds: the worker computes the rest.
        usage = api_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=0,
                              cached_prompt_tokens=route.cached_tokens)
        try:
            served = yield from self._local(context, rid, prompt_ids, sampling, text, usage,
                                            trip, route.address, route.chunk_tokens, what)
        finally:  # it holds only while this worker serves the request
            self.workers.release_taken(route.address, route.taken)
        if served is not None:
            return served
        req = self._local_request(rid, prompt_ids, sampling, trip)
        yield from self._decode(context, req, text, usage, trip, dead=frozenset({route.address}))
        return True

    def _follow(self, context, rid, prompt_ids, sampling, text: OutputText, trip: Trip,
                address: str):
        """A further choice on the decode worker `address` that decodes the first choice: it
        holds the prompt's full blocks, so this choice computes only the last partial block
        (under a block: it takes no local-prefill lease). True when served (or resumed
        elsewhere after that worker broke), False when refused before a token (plan on)."""
        usage = api_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=0,
                              cached_prompt_tokens=0)
        served = yield from self._local(context, rid, prompt_ids, sampling, text, usage, trip,
                                        address, 0, "local_prefill")
        if served is not None:
            return served
        req = self._local_request(rid, prompt_ids, sampling, trip)
        yield from self._decode(context, req, text, usage, trip, dead=frozenset({address}))
        return True

    def _local(self, context, rid, prompt_ids, sampling, text: OutputText, usage, trip: Trip,
               address: str, chunk: int, what: str):
        """The request on `address`, which prefills it itself (`chunk` tokens a step at most,
        0: its step budget): True when served (or the client left), False when refused before
        a token (plan on), None when its stream broke after some and it is to be resumed
        elsewhere. An offload counts as offloaded work for the controller."""
        self.door.picked(trip)
        req = self._local_request(rid, prompt_ids, sampling, trip, chunk)
        hop = _Hop()
        trip.offloaded = what == "offload"
        try:
            call = self._decode_call(address, self.workers.stub(address), req, context)
            if (yield from self._relay(context, rid, call, text, usage, hop, trip, address)):
                if hop.moved:  # resumed elsewhere, on with its KV
                    self._moved(trip, address)
                    return None
                return True
            self._abort(context, trip, grpc.StatusCode.UNAVAILABLE,
                        f"{what}: decode stream ended without a finish reason")
        except grpc.RpcError as e:
            n = self._next(context, trip, self._failure(
                context, trip, LOCAL_HOP, e.code().name, address, 1, hop.relayed), what,
                worker_message(e.code().name, e.details()))
            if n.action == GIVE_UP:
                return True  # the client left
            if n.action == FALL_THROUGH:
                trip.offloaded = False
                return False
        return None  # RESUME

    @staticmethod
    def _moved(trip: Trip, address: str) -> None:
        """Its decode worker moved the request off with its KV (a drain, a shutdown): not a
        failure, nothing waited for or counted against its resumes; the caller resumes it
        elsewhere (`_local_request`), where the blocks are fetched. Its stall is timed from
        its last tokens."""
        log.info("decode on %s moved after %d tokens; resuming on another decode worker",
                 address, len(trip.emitted))
        trip.moved_s = trip.last_s

    def _decode_call(self, address: str, stub, req: wpb.DecodeRequest, context):
        """Start a decode hop: on the worker's shared stream, or a Decode call of its own."""
        if self.muxes is None:
            return stub.Decode(req, timeout=self._timeout(context))
        return self.muxes.start(address, stub, req, self._timeout(context))

    def _relay(self, context, rid: str, call, text: OutputText, usage, hop: _Hop, trip: Trip,
               address: str):
        """Relay one decode stream (from `address`) as text deltas; True once it ended with a
        finish reason (or a stop string cut it short), False if the stream ended without one.
        On a shared stream with a client in this process (`trip.emit`), the relay runs on the
        stream's reader thread and this one waits for its end (`MuxCall.relay`); else each
        chunk is read and yielded here."""
        # A client that cancels or disconnects cancels the decode: the worker frees the KV.
        if not context.add_callback(call.cancel):
            call.cancel()  # the client already left: the callback never runs
        step = functools.partial(self._relay_step, rid, text, usage, hop, trip, address)
        with self.door.worker_call(call):
            try:
                emit = trip.emit
                if emit is not None and isinstance(call, MuxCall):
                    def on_chunk(chunk) -> bool:
                        message, done = step(chunk)
                        if message is not None:
                            emit(message)
                        return done
                    return call.relay(on_chunk)
                for chunk in call:
                    message, done = step(chunk)
                    if text.stopped:
                        call.cancel()
                    if message is not None:
                        yield message
                    if done:
                        return True
            finally:
                # Ended: a no-op. Left early (the relay closed, an error here): the worker
                # stops decoding for nobody.
                call.cancel()
        return False

    def _relay_step(self, rid: str, text: OutputText, usage, hop: _Hop, trip: Trip,
                    address: str, chunk) -> tuple[api_pb2.GenerateResponse | None, bool]:
        """One decode chunk: the message for the client (None: nothing to send yet) and whether
        the relay is done (a finish reason or a stop string). Every token relayed is added to
        `trip.emitted`; the first one tells the other choices of a request where this one
        decodes."""
        if chunk.moved:  # the last message of a request its worker moved: nothing to send
            hop.moved = True
            return None, True
        if trip.lead is not None:
            trip.lead.publish(address)
        if chunk.made_unix_s > 0:
            self.metrics.worker_hop.observe(max(0.0, time.time() - chunk.made_unix_s))
        usage.completion_tokens += len(chunk.token_ids)
        trip.emitted.extend(chunk.token_ids)
        delta = text.push(chunk.token_ids)
        finish = None
        if text.stopped:
            finish = fin.STOP
        elif chunk.finish_reason != _UNSET:
            finish = finish_from_proto(chunk.finish_reason)
        if finish is not None:
            hop.relayed = True
            return self._final(rid, delta + text.finish(), list(chunk.token_ids), finish, usage,
                               chunk.logprobs, chunk.prompt_logprobs), True
        if delta or chunk.token_ids:
            hop.relayed = True
            return api_pb2.GenerateResponse(request_id=rid, text=delta,
                                            token_ids=list(chunk.token_ids),
                                            logprobs=chunk.logprobs,
                                            prompt_logprobs=chunk.prompt_logprobs), False
        return None, False

    @staticmethod
    def _final(rid, text, token_ids, finish, usage, logprobs=(), prompt_logprobs=()):
        return api_pb2.GenerateResponse(request_id=rid, text=text, token_ids=token_ids,
                                        finish_reason=finish_to_proto(finish), usage=usage,
                                        logprobs=logprobs, prompt_logprobs=prompt_logprobs)
