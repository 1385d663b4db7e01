"""A request's decode hop through the router, and the paths that prefill on a decode worker.

Owns `DecodeHops`, a mixin of `service.RouterService` (its `workers`, `door`, `metrics`,
`muxes` and its failure handling: `_next`, `_failure`, `_abort`, `_timeout`): the decode hop
(`_decode`: re-routed while it relayed nothing, resumed on another decode worker once it has,
and at once when its worker moved it off with its KV), a request prefilled and decoded on one
decode worker (`_local_path`: CACHED_LOCAL or OFFLOAD; `_follow`: a further choice where the
first one decodes; `_local`: that call), the `DecodeRequest` of a decode that prefills on its
worker (`_local_request`) and the start of a decode call, on the worker's shared stream or one
of its own (`_decode_call`). Must not choose workers (`pool.WorkerSet` does) nor what follows a
failure (`route.after_failure` does); the stream's relay is `relay.py`'s.
"""

from __future__ import annotations

import logging

import grpc

from pdserve.core.roles import DECODE
from pdserve.proto import api_pb2
from pdserve.proto import worker_pb2 as wpb
from pdserve.router.lifecycle import Trip
from pdserve.router.policy import NoWorkerError
from pdserve.router.relay import Hop, call_failure, relay
from pdserve.router.retry import worker_message
from pdserve.router.route import (DECODE_HOP, FALL_THROUGH, GIVE_UP, LOCAL_HOP, OFFLOAD, RETRY,
                                  Route)
from pdserve.router.text import OutputText

log = logging.getLogger(__name__)


class DecodeHops:
    @staticmethod
    def _local_request(rid: str, prompt_ids, sampling, trip: Trip, chunk_tokens: int = 0
                       ) -> wpb.DecodeRequest:
        """A decode that prefills on its worker: the prompt, then (resuming) every token the
        client already got. Only the tenant's salt of a KV handle: prompts hash apart."""
        return wpb.DecodeRequest(request_id=rid, prompt_token_ids=prompt_ids, sampling=sampling,
                                 prefill_locally=True, prefill_chunk_tokens=chunk_tokens,
                                 resume_token_ids=trip.emitted,
                                 kv=wpb.KvHandle(tenant_salt=trip.tenant))

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
            hop, tracked = Hop(), None
            try:
                with self.workers.pick(DECODE, req.prompt_token_ids,
                                       extra_tokens=req.sampling.max_tokens,
                                       exclude=frozenset(refused) | dead) as (address, stub):
                    self.door.picked(trip)
                    attempt += 1
                    call = self._decode_call(address, stub, req, context)
                    with self.workers.calls.tracking(address, call) as tracked:
                        done = yield from relay(self.door, self.metrics, context,
                                                req.request_id, call, text, usage, hop, trip,
                                                address)
                        if done and not hop.moved:
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
                code, message = call_failure(e, tracked, DECODE, address)
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
        hop = Hop()
        trip.offloaded = what == "offload"
        try:
            call = self._decode_call(address, self.workers.stub(address), req, context)
            if (yield from relay(self.door, self.metrics, context, rid, call, text, usage, hop,
                                 trip, address)):
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
