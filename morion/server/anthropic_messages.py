"""The Anthropic Messages API: `POST /v1/messages` (whole or streamed) and `/v1/messages/count_tokens`.

So that agent clients built for it can point at a local model unchanged: a request becomes a chat request
(`system`, text / `tool_use` / `tool_result` blocks to messages, `tools` with `input_schema` to chat
tools, `tool_choice` auto / any / tool / none), runs like one, and its answer is written as content
blocks (`thinking` with `--reasoning-parser`, `text`, `tool_use`) in the order the model wrote them;
streamed as the API's events, a tool's input as `input_json_delta` pieces. Errors have Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`). The key may come as `x-api-key` (app.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from morion.server.chat_stream import REASONING, TEXT, TOOL_CALL, BlockEvent, Finished, answer_blocks
from morion.server.errors import APIError
from morion.server.protocol import MAX_INT32, CacheSalt, ChatCompletionRequest, parse_body
from morion.server.request_log import note_generation
from morion.server.sse import respond

if TYPE_CHECKING:
    from morion.server.app import ServerContext

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class Tool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Body):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_INT32)
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    cache_salt: CacheSalt | None = None  # vLLM's extension, as on chat completions


class CountTokensRequest(_Body):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None


def register_messages_api(api: APIRouter, context: ServerContext) -> None:
    @api.post("/v1/messages")
    async def create(request: Request) -> Any:
        try:
            return await _create(request, context)
        except APIError as error:
            return anthropic_error(error)

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Any:
        try:
            context.ready_info()
            body: CountTokensRequest = await context.read_json(request, CountTokensRequest)
            chat = _chat_request(body, max_tokens=None)
            rendered = await asyncio.to_thread(context.render_chat_request, chat)
            return {"input_tokens": len(rendered.token_ids)}
        except APIError as error:
            return anthropic_error(error)


def anthropic_error(error: APIError) -> JSONResponse:
    kind = _ERROR_TYPES.get(error.status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": error.message}}
    return JSONResponse(body, status_code=error.status)


async def _create(request: Request, context: ServerContext) -> Any:
    arrival = time.perf_counter()
    info = context.ready_info()
    body: MessagesRequest = await context.read_json(request, MessagesRequest)
    chat = _chat_request(body, body.max_tokens)
    prepared = await context.prepare_chat(chat, info)
    stream = context.client.submit(prepared.job.submissions(), arrival, request.scope)
    writer = _MessageWriter(body, context.served_names[0], len(prepared.rendered.token_ids))
    note_generation(request, lambda: stream.time_to_first_token, writer.usage_body)
    events = writer.events(answer_blocks(stream, prepared.new_parser))
    return await respond(request, events, stream.close, body.stream, lambda: writer.message)


def _chat_request(
    body: MessagesRequest | CountTokensRequest, max_tokens: int | None
) -> ChatCompletionRequest:
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system, "system")})
    for index, message in enumerate(body.messages):
        messages += _chat_messages(message, index)
    chat: dict[str, Any] = {"messages": messages}
    if body.model is not None:
        chat["model"] = body.model
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    if isinstance(body, MessagesRequest):
        for name, value in (
            ("temperature", body.temperature),
            ("top_p", body.top_p),
            ("top_k", body.top_k),
            ("stop", body.stop_sequences),
            ("cache_salt", body.cache_salt),
        ):
            if value is not None:
                chat[name] = value
        if body.thinking is not None and body.thinking.get("type") in ("enabled", "disabled"):
            chat["chat_template_kwargs"] = {"enable_thinking": body.thinking["type"] == "enabled"}
        choice = body.tool_choice
        if choice is not None:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function",
                "function": {"name": choice.name or ""},
            }
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    **({"description": tool.description} if tool.description else {}),
                    "parameters": tool.input_schema,
                },
            }
            for tool in body.tools
        ]
    return parse_body(json.dumps(chat).encode(), ChatCompletionRequest)


def _chat_messages(message: Message, index: int) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: tool results become tool messages, tool uses tool calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for number, block in enumerate(message.content):
        where = f"messages[{index}].content[{number}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and message.role == "assistant":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            call = {"name": str(block.get("name", "")), "arguments": arguments}
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": call})
        elif kind == "tool_result" and message.role == "user":
            content = _text(block.get("content") or "", where)
            results.append(
                {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": content}
            )
        elif kind not in ("thinking", "redacted_thinking"):  # earlier thinking is not shown again
            raise APIError(400, f"{where}: unsupported content block type {kind!r}", param=where)
    turn: list[dict[str, Any]] = list(results)
    if message.role == "assistant":
        entry: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            entry["tool_calls"] = calls
        turn.append(entry)
    elif texts or not results:
        turn.append({"role": "user", "content": "".join(texts)})
    return turn


def _text(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if not (isinstance(block, dict) and block.get("type") == "text"):
            raise APIError(400, f"{where}: only text blocks are supported here", param=where)
        parts.append(str(block.get("text", "")))
    return "".join(parts)


class _MessageWriter:
    """The message object and its stream events, built from the answer's blocks."""

    def __init__(self, body: MessagesRequest, served_name: str, prompt_tokens: int) -> None:
        self.body = body
        self.message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": body.model or served_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": prompt_tokens,
                "output_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0,
            },
        }
        self._arguments: list[str] = []  # the open tool_use block's input JSON so far

    def usage_body(self) -> dict[str, Any]:
        usage = self.message["usage"]
        return {
            "prompt_tokens": usage["input_tokens"],
            "completion_tokens": usage["output_tokens"],
            "prompt_tokens_details": {"cached_tokens": usage["cache_read_input_tokens"]},
        }

    async def events(self, blocks: AsyncIterator[BlockEvent | Finished]) -> AsyncIterator[bytes]:
        yield _event("message_start", message=_copy(self.message))
        try:
            async for event in blocks:
                if isinstance(event, Finished):
                    for done in self._finish(event):
                        yield done
                    return
                payload = self._block(event)
                if payload is not None:
                    yield payload
        except APIError as error:
            if not self.body.stream:
                raise
            kind = _ERROR_TYPES.get(error.status, "api_error")
            yield _event("error", error={"type": kind, "message": error.message})

    def _block(self, event: BlockEvent) -> bytes | None:
        content = self.message["content"]
        if event.action == "start":
            if event.kind == TOOL_CALL:
                block = {
                    "type": "tool_use",
                    "id": f"toolu_{uuid.uuid4().hex[:24]}",
                    "name": event.name,
                    "input": {},
                }
                self._arguments = []
            elif event.kind == REASONING:
                block = {"type": "thinking", "thinking": "", "signature": ""}
            else:
                block = {"type": "text", "text": ""}
            content.append(block)
            return _event("content_block_start", index=len(content) - 1, content_block=_copy(block))
        block, index = content[-1], len(content) - 1
        if event.action == "stop":
            if event.kind == TOOL_CALL:
                block["input"] = _input(self._arguments)
            return _event("content_block_stop", index=index)
        if event.kind == TOOL_CALL:
            self._arguments.append(event.text)
            delta = {"type": "input_json_delta", "partial_json": event.text}
        elif event.kind == REASONING:
            block["thinking"] += event.text
            delta = {"type": "thinking_delta", "thinking": event.text}
        else:
            assert event.kind == TEXT
            block["text"] += event.text
            delta = {"type": "text_delta", "text": event.text}
        return _event("content_block_delta", index=index, delta=delta)

    def _finish(self, finished: Finished) -> list[bytes]:
        message = self.message
        stop_sequences = self.body.stop_sequences or []
        if finished.called_tools and finished.reason == "stop":
            message["stop_reason"] = "tool_use"
        elif finished.reason == "length":
            message["stop_reason"] = "max_tokens"
        elif isinstance(finished.stop_reason, str) and finished.stop_reason in stop_sequences:
            message["stop_reason"], message["stop_sequence"] = "stop_sequence", finished.stop_reason
        else:
            message["stop_reason"] = "end_turn"
        usage = message["usage"]
        usage.update(
            input_tokens=finished.usage.prompt_tokens - finished.usage.cached_tokens,
            cache_read_input_tokens=finished.usage.cached_tokens,
            output_tokens=finished.usage.completion_tokens,
        )
        delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        return [_event("message_delta", delta=delta, usage=dict(usage)), _event("message_stop")]


def _input(pieces: list[str]) -> Any:
    """A tool's input: the streamed arguments parsed (a model's broken JSON: the text, under `_raw`)."""
    text = "".join(pieces) or "{}"
    try:
        value = json.loads(text)
    except ValueError:
        return {"_raw": text}
    return value if isinstance(value, dict) else {"_raw": text}


def _event(kind: str, **fields: Any) -> bytes:
    data = json.dumps({"type": kind, **fields}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(value))
