"""The FastAPI app: routes, authentication, body limits and error bodies.

Bodies are read and validated by hand (`read_json` + `parse_body`) rather than by FastAPI, so that every
rejection, from an oversized or malformed body to a bad field, is an OpenAI-style error naming the problem.
Templates, tokenization and grammar compilation run in worker threads (the tokenizer releases the GIL
for long texts, `Tokenizer.encode`), so that a huge prompt never stalls the event loop and the requests it
serves. There is no trailing-slash redirect: it would echo the client's Host header back as a Location.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NamedTuple

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from morion.multimodal.image_decode import PreparedImage
from morion.server.anthropic_messages import register_messages_api
from morion.server.arrivals import ArrivalsMiddleware
from morion.server.chat_images import chat_images, with_image_tokens
from morion.server.chat_tools import ChatTooling
from morion.server.completion_format import CompletionFormat
from morion.server.describe import server_info
from morion.server.engine_client import DRAINING, FAILED, LOADING, READY, EngineClient
from morion.server.engine_messages import EngineInfo
from morion.server.errors import APIError, error_body
from morion.server.http_guards import install_browser_guards
from morion.server.options import ServeOptions
from morion.server.parsers.chat_output import ChatOutputParser
from morion.server.prepare import (
    EngineJob,
    RenderedChat,
    chat_echo,
    chat_job,
    check_model,
    check_vocabulary,
    completion_job,
    render_chat,
)
from morion.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)
from morion.server.request_log import RequestLogger
from morion.server.responses import ChatFormat, TokenTexts
from morion.server.responses_api import register_responses_api
from morion.server.serving import run_job
from morion.server.structured import GrammarService, chat_constraint, completion_constraint
from morion.text.tokenizer import Tokenizer

logger = logging.getLogger("morion.server")


class PreparedChat(NamedTuple):
    rendered: RenderedChat
    job: EngineJob
    new_parser: Callable[[], ChatOutputParser | None]


class ServerContext:
    """What the routes share: options, the engine client and the front end's tokenizer."""

    def __init__(
        self,
        options: ServeOptions,
        client: EngineClient,
        tokenizer: Tokenizer | None,
        served_names: list[str],
        on_ready: Callable[[EngineInfo], None],
        on_fatal: Callable[[str], None],
    ) -> None:
        self.options = options
        self.client = client
        self.tokenizer = tokenizer
        self.served_names = served_names
        self.token_texts = TokenTexts(tokenizer)
        self.on_ready = on_ready
        self.on_fatal = on_fatal
        self.tooling = ChatTooling(tokenizer, options.tool_call_parser, options.reasoning_parser)
        self._grammars: GrammarService | None = None

    def grammars(self, info: EngineInfo) -> GrammarService:
        if self._grammars is None:
            options = self.options
            memory = int(options.grammar_memory_gb * 2**30)
            self._grammars = GrammarService(self.tokenizer, info.vocab_size, options.grammar_timeout, memory)
        return self._grammars

    async def close(self) -> None:
        """Stops the engine and the grammar compiler (the lifespan's end)."""
        if self._grammars is not None:
            await asyncio.to_thread(self._grammars.close)
        await self.client.close()

    def stop_at_once(self) -> None:
        """Kills the engine and grammar processes without waiting (a second signal; signal-handler safe)."""
        self.client.kill_now()
        if self._grammars is not None:
            self._grammars.kill()

    async def prepare_chat(self, body: ChatCompletionRequest, info: EngineInfo) -> PreparedChat:
        """A chat request's prompt, grammar and engine job, and how to parse each choice's output (the
        chat, Responses and Messages endpoints all come through here). The images are read and prepared in a
        worker thread, then the template, tokenization and the grammar's spec in another, its compilation in
        the bounded grammar process."""
        rendered, images = await self.render_chat_with_images(body, info)
        constraint = await asyncio.to_thread(chat_constraint, body, self.tooling.tool_parser)
        grammar = await self.grammars(info).compile(constraint) if constraint else None
        job = chat_job(body, rendered.token_ids, info, grammar)._replace(images=tuple(images))

        def new_parser() -> ChatOutputParser | None:
            return self.tooling.output_parser(body, rendered.text, constrained=grammar is not None)

        return PreparedChat(rendered, job, new_parser)

    def render_chat_request(self, body: ChatCompletionRequest) -> RenderedChat:
        """The prompt of a chat request: tools checked, then shown to the model as its template can."""
        self.tooling.check(body)
        messages, tools = self.tooling.template_inputs(body)
        return render_chat(
            self.tokenizer,
            messages,
            body.add_generation_prompt,
            body.chat_template_kwargs,
            tools,
            body.continue_final_message,
        )

    async def render_chat_with_images(
        self, body: ChatCompletionRequest, info: EngineInfo
    ) -> tuple[RenderedChat, list[PreparedImage]]:
        """The prompt with its images' tokens in place of their placeholders (server/chat_images.py). The
        images come first: a model that takes none refuses them before its template sees them."""
        local_media = self.options.allowed_local_media_path
        images = await chat_images(body, info, None if local_media is None else Path(local_media))

        def render() -> RenderedChat:  # a worker thread's: templates and tokenization take the CPU
            return with_image_tokens(self.render_chat_request(body), images, info)

        return await asyncio.to_thread(render), images

    def ready_info(self) -> EngineInfo:
        state = self.client.state
        if state == READY and self.client.info is not None:
            return self.client.info
        reasons = {
            LOADING: "the model is still loading; retry when /health answers 200",
            DRAINING: "the server is shutting down",
            FAILED: f"the engine failed: {self.client.failure}",
        }
        raise APIError(503, reasons.get(state, "the server is shutting down"), code="not_ready")

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return self.tokenizer

    async def read_json(self, request: Request, model: type[Any]) -> Any:
        """The body, validated as `model`: 413 past --max-request-bytes, 408 when it has not all arrived
        within --read-timeout seconds, 400 when it is not a valid `model`."""
        timeout = self.options.read_timeout
        try:
            body = await asyncio.wait_for(self._read_body(request), timeout)
        except asyncio.TimeoutError:
            raise APIError(
                408, f"the request body did not arrive within {timeout:g} s (--read-timeout)", code="timeout"
            ) from None
        parsed = parse_body(body, model)
        check_model(getattr(parsed, "model", None), self.served_names)
        self.client.arrivals.body_read(request.scope)  # a generation request counts until its hand-over
        return parsed

    async def _read_body(self, request: Request) -> bytes:
        limit = self.options.max_request_bytes
        declared = request.headers.get("content-length", "")
        too_large = APIError(
            413,
            f"the request body is larger than {limit} bytes (--max-request-bytes)",
            code="request_too_large",
        )
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)


def create_app(context: ServerContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await context.client.connect(context.on_ready, context.on_fatal)
        yield
        await context.close()

    app = FastAPI(title="morion", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # A trailing slash is a 404 with a JSON body, not a redirect: clients do not follow it, and its
    # Location would echo the client's Host header back.
    app.router.redirect_slashes = False
    install_browser_guards(app, context.options.allowed_origins)
    app.add_middleware(_RequestCounter, context=context)  # outside the guards: counts their refusals too
    app.add_middleware(ArrivalsMiddleware, arrivals=context.client.arrivals)
    if context.options.log_requests:
        app.add_middleware(RequestLogger)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)

    @app.get("/health")
    async def health() -> Response:
        state = context.client.state
        return JSONResponse(
            {"status": "ok" if state == READY else state}, status_code=200 if state == READY else 503
        )

    api = APIRouter(dependencies=[Depends(_authenticator(context.options.api_key))])

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(
            context.client.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @api.get("/v1/server_info")
    async def info() -> dict[str, Any]:
        client = context.client
        return server_info(
            context.options,
            context.served_names,
            client.state,
            client.info,
            client.stats,
            {**context.tooling.describe(), "tokenizer": context.tokenizer is not None},
        )

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = context.ready_info()
        return {"object": "list", "data": [_model_card(name, info) for name in context.served_names]}

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        info = context.ready_info()
        check_model(model_id, context.served_names)
        return _model_card(model_id, info)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        arrival = time.perf_counter()
        info = context.ready_info()
        body: ChatCompletionRequest = await context.read_json(request, ChatCompletionRequest)
        chat = await context.prepare_chat(body, info)
        response_format = ChatFormat(
            _response_id("chatcmpl"),
            _model(body, context),
            context.token_texts,
            body.logprobs,
            output_parser=chat.new_parser,
            reasoning=context.tooling.reasoning_parser is not None,
            echo=chat_echo(body),
            prompt_token_ids=chat.rendered.token_ids,
            return_token_ids=body.return_token_ids,
        )
        return await run_job(
            request, context.client, chat.job, response_format, body.stream, body.include_usage, arrival
        )

    @api.post("/v1/completions")
    async def completions(request: Request) -> Any:
        arrival = time.perf_counter()
        info = context.ready_info()
        body: CompletionRequest = await context.read_json(request, CompletionRequest)
        constraint = completion_constraint(body)
        grammar = await context.grammars(info).compile(constraint) if constraint else None
        job = await asyncio.to_thread(completion_job, body, context.tokenizer, info, grammar)
        response_format = CompletionFormat(
            _response_id("cmpl"), _model(body, context), context.token_texts, body, job, context.tokenizer
        )
        return await run_job(
            request, context.client, job, response_format, body.stream, body.include_usage, arrival
        )

    @api.post("/v1/cache/evict_device")
    async def evict_device_cache() -> dict[str, Any]:
        # Operators and `morion validate restore`: conversations leave GPU memory and are served from
        # the host or disk tier next time (or recomputed without tiers); running requests keep theirs.
        context.ready_info()
        pages = await context.client.evict_device_cache()
        return {"object": "cache.eviction", "tier": "device", "evicted_pages": pages}

    @api.post("/v1/chat/completions/render")
    async def render(request: Request) -> dict[str, Any]:
        info = context.ready_info()
        body: ChatCompletionRequest = await context.read_json(request, ChatCompletionRequest)
        rendered, _ = await context.render_chat_with_images(body, info)
        return {
            "prompt": rendered.text,
            "token_ids": rendered.token_ids,
            "count": len(rendered.token_ids),
            "max_model_len": info.max_model_len,
        }

    @api.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        info = context.ready_info()
        body: TokenizeRequest = await context.read_json(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            messages = [message.for_template() for message in body.messages]
            template_kwargs = body.chat_template_kwargs
            rendered = await asyncio.to_thread(
                render_chat, context.tokenizer, messages, body.add_generation_prompt, template_kwargs
            )
            token_ids = rendered.token_ids
        else:
            tokenizer = context.require_tokenizer()
            token_ids = await asyncio.to_thread(
                tokenizer.encode, body.prompt or "", add_special_tokens=body.add_special_tokens
            )
        return {"tokens": token_ids, "count": len(token_ids), "max_model_len": info.max_model_len}

    @api.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        info = context.ready_info()
        body: DetokenizeRequest = await context.read_json(request, DetokenizeRequest)
        check_vocabulary(body.tokens, info, "tokens")
        return {"prompt": await asyncio.to_thread(context.require_tokenizer().decode, body.tokens)}

    register_responses_api(api, context)
    register_messages_api(api, context)
    app.include_router(api)
    return app


def _authenticator(api_key: str | None) -> Callable[[Request], None]:
    expected = api_key.encode() if api_key is not None else None

    def authenticate(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
            token = request.headers.get("x-api-key", "")
        if not secrets.compare_digest(token.strip().encode(), expected):
            raise APIError(
                401, "a valid API key is required: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )

    return authenticate


def _model_card(name: str, info: EngineInfo) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "morion",
        "max_model_len": info.max_model_len,
    }


def _response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _model(body: Any, context: ServerContext) -> str:
    return body.model or context.served_names[0]


async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, APIError)
    # Past a body limit or deadline the rest of the body is not read: the connection cannot be reused.
    headers = {"connection": "close"} if error.status in (408, 413) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    message = str(error.detail)
    if error.status_code == 404:
        message = f"{request.method} {request.url.path} is not an endpoint of this server"
    elif error.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    return JSONResponse(error_body(error.status_code, message), status_code=error.status_code)


async def _internal_error(request: Request, error: Exception) -> Response:
    # The exception's text stays in the log: it may show paths, values or other requests' data.
    reference = uuid.uuid4().hex[:12]
    logger.error("unexpected error %s in %s %s", reference, request.method, request.url.path, exc_info=error)
    message = f"an internal error; the server log has its traceback (reference {reference})"
    return JSONResponse(error_body(500, message), status_code=500)


class _RequestCounter:
    """Counts HTTP responses by route and status (morion_http_requests_total); unknown paths are "other",
    so the label set stays bounded."""

    def __init__(self, app: ASGIApp, context: ServerContext) -> None:
        self.app = app
        self.context = context

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in _ENDPOINTS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.context.client.metrics.http_requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


_ENDPOINTS = frozenset(
    {
        "/health",
        "/metrics",
        "/v1/server_info",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/chat/completions/render",
        "/tokenize",
        "/detokenize",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
)
