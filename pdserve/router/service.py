"""The router's gRPC service: Generate (prefill on one pool, decode on the other) and ListModels.

Owns a request's trip through the cluster: validate and tokenize, pick a prefill worker, send the
first token to the client as soon as it exists (that is TTFT), hand the KV handle to a decode
worker, relay its tokens as final text deltas, and stop the decode when a stop string appears or
the client goes away. Must not run the model.
"""

from __future__ import annotations

import logging
import threading
import uuid
from contextlib import contextmanager

import grpc

from pdserve import rpc
from pdserve.engine.sampling import InvalidArgumentError
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from pdserve.router.policy import LeastLoaded, NoWorkerError, RoundRobin, WorkerLoad
from pdserve.router.text import OutputText
from pdserve.router.validate import check_model, prompt_ids_of, sampling_of
from pdserve.wire import finish_from_proto, finish_to_proto, params_to_proto

log = logging.getLogger(__name__)


class WorkerPool:
    """The router's view of one role's workers: stubs plus requests in flight per worker."""

    def __init__(self, addresses: tuple[str, ...], policy) -> None:
        self.addresses = list(addresses)
        self.channels = [rpc.make_channel(a) for a in self.addresses]
        self.stubs = [wpb_grpc.WorkerStub(c) for c in self.channels]
        self.in_flight = [0] * len(self.addresses)
        self.policy = policy
        self._lock = threading.Lock()

    @contextmanager
    def pick(self):
        with self._lock:
            i = self.policy.choose([WorkerLoad(a, n) for a, n in zip(self.addresses, self.in_flight)])
            self.in_flight[i] += 1
        try:
            yield self.stubs[i]
        finally:
            with self._lock:
                self.in_flight[i] -= 1

    def close(self) -> None:
        for c in self.channels:
            c.close()


class RouterService(api_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer, model_config, model_names: tuple[str, ...], max_model_len: int,
                 prefill: WorkerPool, decode: WorkerPool, timeout_s: float = 600.0) -> None:
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

    def Generate(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        try:
            check_model(request.model, self.model_names)
            prompt_ids = prompt_ids_of(request, self.tokenizer, self.model_config.vocab_size)
            params = sampling_of(request, len(prompt_ids), self.max_model_len, self.model_config)
        except InvalidArgumentError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        sampling = params_to_proto(params)
        text = OutputText(self.tokenizer, prompt_ids, params.stop)
        try:
            with self.prefill.pick() as stub:
                pre = stub.Prefill(wpb.PrefillRequest(request_id=rid, prompt_token_ids=prompt_ids,
                                                      sampling=sampling),
                                   timeout=self._timeout(context))
        except grpc.RpcError as e:
            context.abort(e.code(), f"prefill: {e.details()}")
        except NoWorkerError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill: {e}")
        usage = api_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=1,
                              cached_prompt_tokens=pre.num_cached_tokens)
        first = pre.first_token_id
        delta = text.push([first])
        finish = "stop" if text.stopped else finish_from_proto(pre.finish_reason)
        if finish is not None:
            yield self._final(rid, delta + text.finish(), [first], finish, usage)
            return
        yield api_pb2.GenerateResponse(request_id=rid, text=delta, token_ids=[first])
        yield from self._decode(rid, context, prompt_ids, first, sampling, pre.kv, text, usage)

    def _decode(self, rid, context, prompt_ids, first, sampling, kv, text: OutputText, usage):
        finish = None
        try:
            with self.decode.pick() as stub:
                call = stub.Decode(wpb.DecodeRequest(request_id=rid, prompt_token_ids=prompt_ids,
                                                     first_token_id=first, sampling=sampling, kv=kv),
                                   timeout=self._timeout(context))
                # A client that cancels or disconnects cancels the decode: the worker frees the KV.
                context.add_callback(call.cancel)
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
                                          finish, usage)
                        return
                    if delta or chunk.token_ids:
                        yield api_pb2.GenerateResponse(request_id=rid, text=delta,
                                                       token_ids=list(chunk.token_ids))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and not context.is_active():
                return  # the client left; nothing to send
            context.abort(e.code(), f"decode: {e.details()}")
        except NoWorkerError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"decode: {e}")
        context.abort(grpc.StatusCode.INTERNAL, "decode stream ended without a finish reason")

    @staticmethod
    def _final(rid, text, token_ids, finish, usage):
        return api_pb2.GenerateResponse(request_id=rid, text=text, token_ids=token_ids,
                                        finish_reason=finish_to_proto(finish), usage=usage)
