"""The OpenAI Responses API: `POST /v1/responses` (whole or streamed), `GET /v1/responses/{id}`.

A request becomes a chat request (`input` items and `instructions` to messages, flat function tools to
chat tools, `text.format` to `response_format`), runs like one, and its answer is written as output
items: a `reasoning` item (with `--reasoning-parser`), a `message` with `output_text`, and one
`function_call` item per call, in the order the model wrote them; streamed as the API's typed events,
call arguments piece by piece. Responses are kept in memory (`store`, the default, up to
`_STORED_RESPONSES`, oldest dropped first), so a later request may continue one with
`previous_response_id`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from morion.server.chat_stream import REASONING, TEXT, TOOL_CALL, BlockEvent, Finished, answer_blocks
from morion.server.errors import APIError
from morion.server.protocol import CacheSalt, ChatCompletionRequest, parse_body
from morion.server.request_log import note_generation
from morion.server.sse import respond

if TYPE_CHECKING:
    from morion.server.app import ServerContext

_STORED_RESPONSES = 256
_UNSUPPORTED = ("background", "prompt", "conversation")  # would change what is answered


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    cache_salt: CacheSalt | None = None  # vLLM's extension, as on chat completions

    def check(self) -> None:
        extras = self.model_extra or {}
        for name in _UNSUPPORTED:
            if extras.get(name):
                raise APIError(400, f"{name} is not supported by this server", param=name)


def register_responses_api(api: APIRouter, context: ServerContext) -> None:
    stored: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    @api.post("/v1/responses")
    async def create(request: Request) -> Any:
        arrival = time.perf_counter()
        info = context.ready_info()
        body: ResponsesRequest = await context.read_json(request, ResponsesRequest)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            if body.previous_response_id not in stored:
                raise _not_found(body.previous_response_id, "previous_response_id")
            history = stored[body.previous_response_id][1]
        messages = history + _messages(body.input)
        chat = _chat_request(body, messages)
        prepared = await context.prepare_chat(chat, info)
        stream = context.client.submit(prepared.job.submissions(), arrival, request.scope)
        writer = _ResponseWriter(body, chat, context.served_names[0])
        note_generation(request, lambda: stream.time_to_first_token, writer.usage_body)

        def keep(response: dict[str, Any]) -> None:
            if body.store:
                stored[response["id"]] = (response, messages + _as_messages(response["output"]))
                while len(stored) > _STORED_RESPONSES:
                    stored.popitem(last=False)

        events = writer.events(answer_blocks(stream, prepared.new_parser), keep)
        return await respond(request, events, stream.close, body.stream, lambda: writer.response)

    @api.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        if response_id not in stored:
            raise _not_found(response_id, "response_id")
        return stored[response_id][0]


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"no stored response {response_id!r}", param=param, code="response_not_found")


def _chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that answers `body` (a field that does not translate is a 400 naming it)."""
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    chat: dict[str, Any] = {"messages": messages, "parallel_tool_calls": body.parallel_tool_calls}
    if body.model is not None:
        chat["model"] = body.model
    for name, value in (
        ("max_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("cache_salt", body.cache_salt),
    ):
        if value is not None:
            chat[name] = value
    if body.tools:
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        choice = body.tool_choice
        chat["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    form = body.text.format if body.text is not None else None
    if form is not None and form.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif form is not None and form.type == "json_schema":
        if form.schema_ is None:
            raise APIError(400, "text.format.schema is required for json_schema", param="text.format.schema")
        schema = {"name": form.name, "schema": form.schema_}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return parse_body(json.dumps(chat).encode(), ChatCompletionRequest)


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    try:
        function = FunctionTool.model_validate(tool)
    except ValidationError as error:
        kind = tool.get("type")
        reason = (
            f"only function tools are supported, got {kind!r}"
            if kind != "function"
            else error.errors()[0]["msg"]
        )
        raise APIError(400, f"tools[{index}]: {reason}", param=f"tools[{index}]") from None
    return {"type": "function", "function": function.model_dump(exclude={"type"}, exclude_none=True)}


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls become one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    400, f"input[{index}].role: unknown role {role!r}", param=f"input[{index}].role"
                )
            messages.append({"role": role, "content": _text(item.get("content"), index)})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", index),
                "type": "function",
                "function": {
                    "name": _field(item, "name", index),
                    "arguments": _field(item, "arguments", index),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, index)
            messages.append(
                {"role": "tool", "tool_call_id": _field(item, "call_id", index), "content": content}
            )
        elif (
            kind != "reasoning"
        ):  # earlier reasoning is not shown to the model again (chat templates drop it)
            raise APIError(
                400, f"input[{index}]: unsupported item type {kind!r}", param=f"input[{index}].type"
            )
    return messages


def _text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content or ():
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(
                400, f"input[{index}].content: only text parts are supported, got {kind!r}", f"input[{index}]"
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _field(item: dict[str, Any], name: str, index: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"input[{index}].{name}: must be a string", param=f"input[{index}].{name}")
    return value


def _as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat turn they continue from."""
    items = [item for item in output if item["type"] != "reasoning"]
    return _messages(items) if items else []


class _ResponseWriter:
    """The response object and its stream events, built from the answer's blocks."""

    def __init__(self, body: ResponsesRequest, chat: ChatCompletionRequest, served_name: str) -> None:
        self.body = body
        self.chat = chat
        self.response: dict[str, Any] = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": body.model or served_name,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning or {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": {"type": "text"}}
            if body.text is None
            else body.text.model_dump(by_alias=True),
            "tool_choice": body.tool_choice
            if isinstance(body.tool_choice, str) or body.tool_choice is None
            else body.tool_choice.model_dump(),
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
        }
        if self.response["tool_choice"] is None:
            self.response["tool_choice"] = "auto"
        self._sequence = 0

    def usage_body(self) -> dict[str, Any]:
        """For the request log, in the chat shape it reads."""
        usage = self.response["usage"] or {}
        prompt = usage.get("input_tokens", 0)
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
        completion = usage.get("output_tokens", 0)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def events(self, blocks: AsyncIterator[BlockEvent | Finished], keep: Any) -> AsyncIterator[bytes]:
        response = self.response
        yield self._event("response.created", response=response)
        yield self._event("response.in_progress", response=response)
        try:
            async for event in self._item_events(blocks, keep):
                yield event
        except APIError as error:
            if not self.body.stream:
                raise
            response["status"] = "failed"
            response["error"] = {"code": error.code or "server_error", "message": error.message}
            yield self._event("response.failed", response=response)

    async def _item_events(
        self, blocks: AsyncIterator[BlockEvent | Finished], keep: Any
    ) -> AsyncIterator[bytes]:
        response = self.response
        item: dict[str, Any] | None = None
        async for event in blocks:
            if isinstance(event, Finished):
                yield self._finish(event, keep)
                return
            if event.action == "start":
                item = self._new_item(event)
                response["output"].append(item)
                yield self._event("response.output_item.added", output_index=self._index, item=_copy(item))
                if event.kind != TOOL_CALL:
                    part = _part(event.kind)
                    yield self._event("response.content_part.added", **self._at(item), part=part)
            elif event.action == "delta" and item is not None:
                yield self._delta(item, event)
            elif event.action == "stop" and item is not None:
                for done in self._item_done(item):
                    yield done

    @property
    def _index(self) -> int:
        return len(self.response["output"]) - 1

    def _new_item(self, event: BlockEvent) -> dict[str, Any]:
        if event.kind == TOOL_CALL:
            return {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": f"call_{uuid.uuid4().hex[:24]}",
                "name": event.name,
                "arguments": "",
                "status": "in_progress",
            }
        if event.kind == REASONING:
            return {
                "type": "reasoning",
                "id": f"rs_{uuid.uuid4().hex}",
                "summary": [],
                "content": [_part(REASONING)],
                "status": "in_progress",
            }
        return {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex}",
            "role": "assistant",
            "status": "in_progress",
            "content": [_part(TEXT)],
        }

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        at = {"item_id": item["id"], "output_index": self._index}
        return at if item["type"] == "function_call" else {**at, "content_index": 0}

    def _delta(self, item: dict[str, Any], event: BlockEvent) -> bytes:
        if item["type"] == "function_call":
            item["arguments"] += event.text
            return self._event("response.function_call_arguments.delta", **self._at(item), delta=event.text)
        item["content"][0]["text"] += event.text
        if item["type"] == "reasoning":
            return self._event("response.reasoning_text.delta", **self._at(item), delta=event.text)
        return self._event("response.output_text.delta", **self._at(item), delta=event.text, logprobs=[])

    def _item_done(self, item: dict[str, Any]) -> list[bytes]:
        item["status"] = "completed"
        at = self._at(item)
        if item["type"] == "function_call":
            done = [self._event("response.function_call_arguments.done", **at, arguments=item["arguments"])]
        else:
            part = item["content"][0]
            kind = (
                "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            )
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            done = [
                self._event(kind, **at, text=part["text"], **extra),
                self._event("response.content_part.done", **at, part=_copy(part)),
            ]
        return [
            *done,
            self._event("response.output_item.done", output_index=at["output_index"], item=_copy(item)),
        ]

    def _finish(self, finished: Finished, keep: Any) -> bytes:
        response = self.response
        usage = finished.usage
        response["usage"] = {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        }
        if finished.reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
            for item in response["output"]:
                item["status"] = "incomplete" if item["status"] != "completed" else item["status"]
        else:
            response["status"] = "completed"
        keep(response)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=response)

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()


def _part(kind: str) -> dict[str, Any]:
    if kind == REASONING:
        return {"type": "reasoning_text", "text": ""}
    return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(value))
