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
conditional disaggregation, on by default). This module holds the trip and the prefill hop;
the decode hop and the paths that prefill on a decode worker are its mixin `decode_hop.DecodeHops`,
and the relay of a decode stream is `relay.py`.
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

import grpc

from pdserve.core import finish as fin
from pdserve.core.sampling_params import InvalidArgumentError
from pdserve.core.structured import Grammars
from pdserve.router import choices
from pdserve.router.choices import Leader
from pdserve.logctx import request_context
from pdserve.metrics import RouterMetrics
from pdserve.proto import api_pb2, api_pb2_grpc
from pdserve.proto import worker_pb2 as wpb
from pdserve.router.admission import Admission
from pdserve.security.tenants import ApiKeys, AuthError
from pdserve.security import failures
from pdserve.router.control import RequestSignals
from pdserve.router.config import DECODE_STREAMS
from pdserve.router.decode_hop import DecodeHops
from pdserve.router.decode_mux import DecodeMuxes
from pdserve.router.lifecycle import Door, Trip, abort_with_hint
from pdserve.core.roles import PREFILL
from pdserve.router.picks import LiveRequest
from pdserve.router.pool import WorkerSet
from pdserve.router.relay import call_failure, final
from pdserve.router.retry import RetryPolicy
from pdserve.router.route import (CACHED_LOCAL, DECODE_FALLBACK, DISAGGREGATED, FALL_THROUGH,
                                  FALLBACK, GIVE_UP, OFFLOAD, PREFILL_HOP, RESUME, RETRY, Failure,
                                  Next, Route, after_failure, plan)
from pdserve.router.text import OutputText
from pdserve.router.validate import check_model, prompt_ids_of, sampling_of
from pdserve.wire import finish_from_proto, params_to_proto

log = logging.getLogger(__name__)


class RouterService(DecodeHops, api_pb2_grpc.GenerationServicer):
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
            yield final(rid, delta + text.finish(), [first], finish, usage, first_lps,
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
                code, message = call_failure(e, tracked, PREFILL, address)
            finally:
                self.workers.release_taken(*taken)
                taken = None
            n = self._next(context, trip, self._failure(
                context, trip, PREFILL_HOP, code, address, attempt), "prefill", message)
            if n.action != RETRY:
                return None
            failed.add(address)
