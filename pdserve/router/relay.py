"""A decode stream relayed to the client, and what a failed worker call says.

Owns `relay` (one decode stream as text deltas: read and yielded here, or for a client in this
process relayed on the shared stream's reader thread), `relay_step` (one chunk: the message for
the client, every token added to `trip.emitted`, a stop string or finish reason ending it, a
`moved` message ending it quietly), `final` (a request's last message: its finish reason and
usage), `Hop` (what one hop relayed) and `call_failure` (a failed worker call's status and
message). Must not pick workers, retry or resume: `service.py` and `decode_hop.py` do.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import grpc

from pdserve.core import finish as fin
from pdserve.metrics import RouterMetrics
from pdserve.proto import api_pb2, common_pb2
from pdserve.router.decode_mux import MuxCall
from pdserve.router.lifecycle import Door, Trip
from pdserve.router.retry import worker_message
from pdserve.router.text import OutputText
from pdserve.wire import finish_from_proto, finish_to_proto

_UNSET = common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class Hop:
    relayed: bool = False  # this hop sent tokens to the client: it can no longer be retried
    moved: bool = False  # its worker moved the request off with its KV: resume it elsewhere


def call_failure(e: Exception, tracked, role: str, address: str) -> tuple[str, str]:
    """(status name, message) of a failed worker call: UNAVAILABLE with the router's reason
    when it ended the call itself (the worker stopped answering: re-routed like a dead one),
    else the worker's status in pdserve's words. A cancel the router did not make is raised."""
    if tracked is not None and tracked.why is not None:
        return "UNAVAILABLE", f"{role} worker {address} {tracked.why}"
    if not isinstance(e, grpc.RpcError):
        raise e
    return e.code().name, worker_message(e.code().name, e.details())


def relay(door: Door, metrics: RouterMetrics, context, rid: str, call, text: OutputText, usage,
          hop: Hop, trip: Trip, address: str):
    """Relay one decode stream (from `address`) as text deltas; True once it ended with a
    finish reason (or a stop string cut it short), False if the stream ended without one.
    On a shared stream with a client in this process (`trip.emit`), the relay runs on the
    stream's reader thread and this one waits for its end (`MuxCall.relay`); else each
    chunk is read and yielded here."""
    # A client that cancels or disconnects cancels the decode: the worker frees the KV.
    if not context.add_callback(call.cancel):
        call.cancel()  # the client already left: the callback never runs
    step = functools.partial(relay_step, metrics, rid, text, usage, hop, trip, address)
    with door.worker_call(call):
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


def relay_step(metrics: RouterMetrics, rid: str, text: OutputText, usage, hop: Hop, trip: Trip,
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
        metrics.worker_hop.observe(max(0.0, time.time() - chunk.made_unix_s))
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
        return final(rid, delta + text.finish(), list(chunk.token_ids), finish, usage,
                     chunk.logprobs, chunk.prompt_logprobs), True
    if delta or chunk.token_ids:
        hop.relayed = True
        return api_pb2.GenerateResponse(request_id=rid, text=delta,
                                        token_ids=list(chunk.token_ids),
                                        logprobs=chunk.logprobs,
                                        prompt_logprobs=chunk.prompt_logprobs), False
    return None, False


def final(rid, text, token_ids, finish, usage, logprobs=(), prompt_logprobs=()):
    """The last message of a request: its finish reason and usage."""
    return api_pb2.GenerateResponse(request_id=rid, text=text, token_ids=token_ids,
                                    finish_reason=finish_to_proto(finish), usage=usage,
                                    logprobs=logprobs, prompt_logprobs=prompt_logprobs)
