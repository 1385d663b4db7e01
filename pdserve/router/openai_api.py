"""The OpenAI-compatible HTTP API of the router: Starlette routes served by uvicorn in a thread.

Owns the HTTP side: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(whole responses or SSE streams ending with `data: [DONE]`), `GET /health` (200 or 503 with a
JSON body saying why, from the router's own `health` when given), request bodies capped in
size, and every error in OpenAI's shape (404 for unknown routes and models, 413 for oversized
bodies, the gRPC status mapped otherwise: see `openai_schema.error_from_status`; a 503 carries
`Retry-After` as a 429 does, and a call that timed out waiting for a worker is a 503, not a
gateway's 504).
Each request is one call of the router's own gRPC `Generate`: in process when the router serves
both (`LocalGeneration`: the servicer on a thread, no loopback stream to serialize every token
into), over loopback gRPC otherwise; so HTTP and gRPC clients get the same validation, routing
and tokens. A client that goes away cancels that call, which cancels the decode on the worker
and frees the request's KV. A chat's tools and its turns' tool calls travel in the gRPC chat's
JSON fields (rendered by the router's chat template); a `required` or named `tool_choice`
becomes the request's structured output (`openai_tools.tool_grammar`).
With API keys configured, every `/v1` route (models included, unknown ones too) needs a known
key before anything else is done, as vLLM's `--api-key`; `/health` and `/metrics` stay open.
The gRPC service still decides the request's tenant from the key passed on.
Must not run the model or pick workers (the gRPC service does both); it tokenizes only a chat
that leaves max_tokens unset (to size it to the rest of the context), and then hands
`Generate` those token ids, so no prompt is tokenized twice.
Other code adds routes (e.g. `/metrics`) through `extra_routes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from pdserve import rpc
from pdserve.core.sampling_params import InvalidArgumentError
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.security.tenants import ApiKeys, AuthError
from pdserve.security import failures
from pdserve.security.access import NO_CREDENTIAL
from pdserve.router.local_call import LocalGeneration
from pdserve.router.openai_format import Renderer, sse, token_texts
from pdserve.router.openai_schema import (ApiRequest, ChatTurn, OpenAIError, bad,
                                          error_from_status, model_not_found, parse_chat,
                                          parse_completion, with_defaults)
from pdserve.router.openai_tools import tool_grammar
from pdserve.router.tool_prompt import has_tool_call_tokens
from pdserve.router.validate import prompt_ids_of

class _ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def grpc_error(e: grpc.aio.AioRpcError, req: ApiRequest) -> OpenAIError:
    trailers = e.trailing_metadata()
    retry = trailers.get("retry-after") if trailers is not None else None
    retry = retry if isinstance(retry, str) else None
    code = e.code().name
    if code == "DEADLINE_EXCEEDED":
        # The router's own call ran out of time waiting for a worker: another component's
        # failure, which the client may retry (503), not a gateway's timeout.
        code = "UNAVAILABLE"
    err = error_from_status(code, e.details() or "", req, retry)
    if err.status == 503 and "Retry-After" not in err.headers:
        err.headers["Retry-After"] = str(_whole_seconds(retry))
    return err


def _whole_seconds(text: str | None) -> int:
    """A Retry-After value: whole seconds, at least 1 (1 when `text` is not a number)."""
    try:
        seconds = float(text) if text is not None else 1.0
    except ValueError:
        seconds = 1.0
    return max(1, math.ceil(min(seconds, 3600.0))) if math.isfinite(seconds) else 1


def _metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The client's API key goes on to the gRPC service, which decides the tenant."""
    auth = request.headers.get("authorization")
    if auth is None:
        return ()
    if not (auth.isascii() and auth.isprintable()):
        raise OpenAIError(401, "the authorization header must be 'Bearer <key>' in ASCII",
                          code="invalid_api_key")
    return (("authorization", auth),)


class _KeyGate:
    """ASGI middleware: with keys configured, a `/v1` request without a known key gets 401
    before routing, so no route (and no 404 or 405) is answered to an unknown caller."""

    def __init__(self, app, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if (scope["type"] == "http" and self.keys.required and scope.get("method") != "OPTIONS"
                and (path == "/v1" or path.startswith("/v1/"))):
            values = [v for k, v in scope.get("headers", ()) if k == b"authorization"]
            try:
                if len(values) != 1:
                    raise AuthError("missing API key: send 'authorization: Bearer <key>'"
                                    if not values else "send one authorization header",
                                    NO_CREDENTIAL)
                self.keys.tenant_of(values[0].decode("latin-1"))
            except AuthError as e:
                failures.record("http", e.reason)
                await error_response(OpenAIError(401, str(e), code="invalid_api_key"))(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (call after the body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIApp:
    """The Starlette app and its client of the router's `Generate` (`generation`: called in
    process; else a gRPC channel to `grpc_target`); the event loop is uvicorn's."""

    def __init__(self, grpc_target: str, model_names: tuple[str, ...], max_model_len: int,
                 tokenizer, vocab_size: int, *, max_body_bytes: int = 1 << 20,
                 request_timeout_s: float = 600.0,
                 extra_routes: Sequence[BaseRoute] = (),
                 health: Callable[[], tuple[bool, dict]] | None = None,
                 api_keys: ApiKeys | None = None,
                 sampling_defaults: Mapping[str, float | int] | None = None,
                 generation: LocalGeneration | None = None) -> None:
        self.grpc_target = grpc_target
        self._generation = generation
        self.model_names = model_names  # the first is the id listed; the rest are accepted too
        self.sampling_defaults = dict(sampling_defaults or {})
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_body_bytes = max_body_bytes
        self.timeout_s = request_timeout_s
        self.health_of = health
        self.token_text = token_texts(tokenizer)
        self.created = int(time.time())
        self._channel: grpc.aio.Channel | None = None
        self._stub: api_pb2_grpc.GenerationStub | LocalGeneration | None = None
        self.routes: list[BaseRoute] = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            *extra_routes,
        ]
        self.app = Starlette(routes=self.routes, lifespan=self._lifespan, exception_handlers={
            HTTPException: self._http_error, Exception: self._internal_error},
            middleware=[Middleware(_KeyGate, keys=api_keys or ApiKeys({}))])

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        # Over loopback only when not handed the router's own calls (a standalone app).
        if self._generation is None or self.health_of is None:
            self._channel = rpc.make_public_aio_channel(self.grpc_target)
        self._stub = self._generation or api_pb2_grpc.GenerationStub(self._channel)
        try:
            yield
        finally:
            if self._generation is not None:
                self._generation.close()
            if self._channel is not None:
                await self._channel.close(grace=None)

    # ---- errors -----------------------------------------------------------------------------
    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            e = OpenAIError(404, f"Invalid URL ({request.method} {request.url.path})",
                            code="unknown_url")
        else:
            e = OpenAIError(exc.status_code, f"{exc.detail} ({request.method} "
                            f"{request.url.path})", code="invalid_request")
        return error_response(e)

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        # Starlette re-raises after this answer, and uvicorn logs the traceback.
        return error_response(OpenAIError(500, f"internal error: {type(exc).__name__}",
                                          code="internal_error"))

    # ---- simple routes ----------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        """One entry per model served (its aliases are accepted in requests, not listed)."""
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_names[0], "object": "model", "created": self.created,
             "owned_by": "pdserve", "root": self.model_names[0],
             "max_model_len": self.max_model_len}]})

    async def health(self, request: Request) -> Response:
        """200 `{"status": "ok", ...}` when a request can be served, else 503 with the reason
        and `Retry-After`. From the router's `health` when given, else from its gRPC health
        service over loopback (the same truth, without the details)."""
        if self.health_of is not None:
            ok, body = self.health_of()
        else:
            ok, body = await self._grpc_health()
        return JSONResponse(body, status_code=200 if ok else 503,
                            headers={} if ok else {"Retry-After": "1"})

    async def _grpc_health(self) -> tuple[bool, dict]:
        assert self._channel is not None
        try:
            resp = await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=2.0)
        except grpc.aio.AioRpcError as e:
            return False, {"status": "not_serving", "reason": f"health check: {e.code().name}"}
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            return True, {"status": "ok"}
        return False, {"status": "not_serving", "reason": "the router's gRPC health is "
                       + health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}

    # ---- generation -------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, parse_chat, "chatcmpl")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion, "cmpl")

    async def _read_json(self, request: Request) -> Any:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = declared.isdigit() and int(declared) > limit
        body = bytearray()
        seen = 0
        # Read (without keeping) what the client sends past the cap, up to a bound, so it
        # sees the 413 instead of a reset connection.
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > limit:
                too_big = True
                if seen > 16 * limit:
                    break
            elif not too_big:
                body += chunk
        if too_big:
            raise OpenAIError(413, f"the request body exceeds {limit} bytes",
                              code="request_too_large")
        if not body:
            raise bad(None, "the request body is empty; expected a JSON object", "invalid_json")
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:
            raise bad(None, f"the request body is not valid JSON: {e}", "invalid_json") from None

    def _generate_request(self, req: ApiRequest, rid: str) -> api_pb2.GenerateRequest:
        if req.model and req.model not in self.model_names:
            raise model_not_found(req.model)
        req = with_defaults(req, self.sampling_defaults)
        s = common_pb2.SamplingParams(top_k=req.top_k, stop=req.stop,
                                      stop_token_ids=req.stop_token_ids,
                                      ignore_eos=req.ignore_eos, temperature=req.temperature)
        for name in ("top_p", "seed", "max_tokens", "logprobs", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                     "prompt_logprobs"):
            if getattr(req, name) is not None:
                setattr(s, name, getattr(req, name))
        s.logit_bias.update(dict(req.logit_bias))
        if req.structured_output is not None:
            s.structured_output.kind = req.structured_output.kind
            s.structured_output.spec = req.structured_output.spec
        g = api_pb2.GenerateRequest(request_id=rid, model=req.model or "", sampling=s,
                                    cache_salt=req.cache_salt, n=req.n, best_of=req.best_of or 0,
                                    suffix=req.suffix)
        if req.kind == "chat":
            g.chat.messages.extend(chat_message(t) for t in req.messages)
            if req.tool_use is not None:
                g.chat.tools_json = req.tool_use.tools_json()
                so = tool_grammar(req.tool_use, has_tool_call_tokens(self.tokenizer))
                if so is not None:  # required or named: the calls are forced (g holds a copy)
                    g.sampling.structured_output.kind = so.kind
                    g.sampling.structured_output.spec = so.spec
            if req.max_tokens is None:
                # As vLLM: a chat without max_tokens may use the rest of the context. The ids
                # counted for it are the prompt Generate gets: the chat is tokenized once.
                try:
                    ids = prompt_ids_of(g, self.tokenizer, self.vocab_size, self.max_model_len)
                except InvalidArgumentError as e:
                    raise error_from_status("INVALID_ARGUMENT", str(e), req) from None
                g.token_ids.ids.extend(ids)  # replaces the chat (one input of the oneof)
                if len(ids) < self.max_model_len:
                    g.sampling.max_tokens = self.max_model_len - len(ids)  # (g holds a copy)
        elif req.prompt_ids is not None:
            g.token_ids.ids.extend(req.prompt_ids)
        else:
            g.prompt = req.prompt or ""
        return g

    async def _generate(self, request: Request, parse: Callable[[Any], ApiRequest],
                        prefix: str) -> Response:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        try:
            metadata = _metadata(request)
            req = parse(await self._read_json(request))
            greq = self._generate_request(req, rid)
        except OpenAIError as e:
            return error_response(e)
        assert self._stub is not None
        call = self._stub.Generate(greq, timeout=self.timeout_s, metadata=metadata)
        echo = ""
        if req.echo:
            echo = req.prompt if req.prompt is not None else self.tokenizer.decode(
                list(req.prompt_ids or ()), skip_special_tokens=False)
        render = Renderer(req, rid, req.model or self.model_names[0], int(time.time()),
                          self.token_text, echo)
        try:
            if req.stream:
                # Wait for the first message, so errors before any token get their own status.
                first = await self._unless_gone(request, call, call.read())
                return self._stream(req, call, first, render)
            msgs = await self._unless_gone(request, call, _collect(call))
        except grpc.aio.AioRpcError as e:
            return error_response(grpc_error(e, req))
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        except BaseException:
            call.cancel()  # e.g. the server shutting down mid-request
            raise
        if not render.complete(msgs):
            return error_response(OpenAIError(500, "generation ended without a finish reason",
                                              code="internal_error"))
        return JSONResponse(render.full(msgs))

    @staticmethod
    async def _unless_gone(request: Request, call, work):
        """Await `work`; if the client disconnects first, cancel the gRPC call."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            call.cancel()
            task.cancel()
            raise _ClientGone()
        finally:
            watch.cancel()

    def _stream(self, req: ApiRequest, call, first, render: Renderer) -> Response:
        async def events():
            try:
                for c in render.first_chunks():
                    yield sse(c)
                msg = first
                ready = getattr(call, "read_ready", lambda: None)
                while msg is not grpc.aio.EOF:
                    # What is already queued goes out in one write.
                    frames = [render.frames(msg)]
                    while not render.done and (more := ready()) is not None:
                        frames.append(render.frames(more))
                    if frames:
                        yield "".join(frames)
                    if render.done:
                        break
                    msg = await call.read()
                else:
                    yield sse(OpenAIError(500, "generation ended without a finish reason",
                                           code="internal_error").body())
            except grpc.aio.AioRpcError as e:
                yield sse(grpc_error(e, req).body())
            finally:
                # A client that left cancels the stream's task here: the router then cancels
                # the decode, and the worker frees the request's KV.
                call.cancel()
            yield "data: [DONE]\n\n"

        return _CallStream(call, events(), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache"})


class _CallStream(StreamingResponse):
    """An SSE response that cancels its gRPC call however the response ends (done, error or
    the client gone mid-write, where the body generator may never be resumed)."""

    def __init__(self, call, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._call = call

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._call.cancel()


def chat_message(t: ChatTurn) -> api_pb2.ChatMessage:
    """A chat turn as the gRPC API takes it (tool calls as JSON text, in OpenAI's shape)."""
    m = api_pb2.ChatMessage(role=t.role, content=t.content, tool_call_id=t.tool_call_id,
                            name=t.name)
    if t.tool_calls:
        m.tool_calls_json = json.dumps([c.openai() for c in t.tool_calls], ensure_ascii=False)
    return m


async def _collect(call) -> list[api_pb2.GenerateResponse]:
    return [m async for m in call]
