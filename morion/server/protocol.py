"""Request bodies of the OpenAI API (and morion's extensions), validated at the edge.

Models are strict (no "5" for 5, no true for 1) and ignore unknown fields, as OpenAI clients send
fields we do not use (`user`, `store`, `metadata`); fields that would change the answer and that morion
cannot honour are rejected by `check` instead of being silently ignored: OpenAI's own (`functions`), and
the extensions other servers take that clients send through `extra_body` (`_OUTPUT_CHANGING_EXTRAS`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from morion.engine.sampling_params import MAX_CACHE_SALT_CHARS
from morion.server.errors import APIError
from morion.server.image_parts import (
    ImageURL,
    ImageURLPart,
    TextPart,
    content_parts,
    image_content_parts,
    joined_text,
    template_parts,
)

MAX_N = 16  # choices per request; each is its own engine request
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 64  # engine requests one HTTP request may start: n x prompts
_MAX_SEED = 2**64 - 1
MAX_INT32 = 2**31 - 1  # top_k and token ids: anything larger is a client bug, never a meaning

_Model = TypeVar("_Model", bound=BaseModel)
# vLLM's `cache_salt`: a request shares cached prefixes only with requests of the same salt
# (SamplingParams.cache_salt). Chat, completions, responses and messages take it alike.
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


class _Body(BaseModel):
    # allow_inf_nan=False: JSON text may spell Infinity, NaN or 1e400, and no field means anything by them.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


# Extensions of other OpenAI-compatible servers (vLLM, SGLang) that change the output and that morion
# does not implement, with the value that changes nothing (None: any value but null changes the output).
_OUTPUT_CHANGING_EXTRAS: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "min_tokens": 0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "allowed_token_ids": None,
    "bad_words": None,
    "logits_processors": None,
    "structural_tag": None,
    "guided_whitespace_pattern": None,
    "truncate_prompt_tokens": None,
    "return_tokens_as_token_ids": False,
    "chat_template": None,
    "documents": None,
    "lora_path": None,
    "no_stop_trim": False,
    "min_new_tokens": 0,
    "thinking_token_budget": None,
}


class StreamOptions(_Body):
    include_usage: bool = False


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class JSONSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object')
        return self


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None  # text parts are joined into one string
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call they answer
    # A user message with image parts: all its parts in order (server/image_parts.py); content is its text.
    _parts: list[TextPart | ImageURLPart] | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_image_parts(cls, data: Any, handler: Any) -> ChatMessage:
        message = handler(data)  # `_join_text_parts` checks every part first
        message._parts = image_content_parts(data)
        if message._parts is not None and message.role != "user":
            raise ValueError(f"content: image parts are only accepted in user messages, not {message.role!r}")
        return message

    @property
    def image_urls(self) -> list[tuple[int, ImageURL]]:
        """(part index, image_url) of each image part, in order."""
        return [
            (i, part.image_url) for i, part in enumerate(self._parts or ()) if isinstance(part, ImageURLPart)
        ]

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        """Text parts joined into one string (the text of a message with images: `_parts` keeps them)."""
        return joined_text(content_parts(value)) if isinstance(value, list) else value

    def for_template(self) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        # A message with images keeps its parts, so that the template shows each image where it stands.
        message["content"] = (self.content or "") if self._parts is None else template_parts(self._parts)
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            # Templates (Qwen, Hermes) read arguments as a mapping; OpenAI sends them as JSON text.
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the template shows what the client sent


class SamplingFields(_Body):
    """Fields shared by /v1/chat/completions and /v1/completions. None means "the default"."""

    model_config = ConfigDict(strict=True, extra="allow")  # `check` looks for known extensions

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, le=_MAX_SEED)
    stop: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # morion (and vLLM) extensions
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)  # 0 or -1: off; above the vocabulary: all
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT32)]] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias in [-100, 100]
    echo: bool = False  # completions: the prompt before the answer; chat: the last assistant message
    # vLLM extensions: the prompt's token ids and each choice's token ids in the response; logprobs of
    # the prompt tokens.
    return_token_ids: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    cache_salt: CacheSalt | None = None
    # Structured output as other servers take it (server/structured.py): SGLang's `regex` and `ebnf`,
    # vLLM's `structured_outputs` and its older `guided_*` fields.
    regex: str | None = Field(None, min_length=1)
    ebnf: str | None = Field(None, min_length=1)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, min_length=1)

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not (token.isascii() and token.isdigit() and len(token) <= 10 and int(token) <= MAX_INT32):
                raise ValueError(f"keys must be token ids, got {_short(token)}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {token}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            if len(value) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(value)}")
            if not all(isinstance(s, str) and s for s in value):
                raise ValueError("must be a non-empty string or a list of non-empty strings")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def token_bias(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(token), float(bias)) for token, bias in (self.logit_bias or {}).items())

    def check(self) -> None:
        """What the field types cannot say: combinations, and fields this server will not silently drop."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        unsupported = self.unsupported_fields()
        if unsupported:
            raise APIError(400, f"{unsupported[0]} is not supported by this server", param=unsupported[0])

    def unsupported_fields(self) -> list[str]:
        extras = self.model_extra or {}
        return [
            name
            for name, neutral in _OUTPUT_CHANGING_EXTRAS.items()
            if name in extras and extras[name] not in (None, [], {}, "") and extras[name] != neutral
        ]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # vLLM's: the last (assistant) message is left open and the answer continues it.
    continue_final_message: bool = False
    functions: list[Any] | None = None
    function_call: Any = None

    def check(self) -> None:
        super().check()
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(
                400,
                "continue_final_message needs add_generation_prompt to be false",
                param="continue_final_message",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError(
                400, "continue_final_message needs an assistant message last", param="continue_final_message"
            )

    def unsupported_fields(self) -> list[str]:
        fields = super().unsupported_fields()
        fields += [name for name in ("functions", "function_call") if getattr(self, name)]
        return fields

    @property
    def tools_enabled(self) -> bool:
        """Tool calls may appear in the answer (and are parsed out of it)."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.for_template() for message in self.messages]


# A prompt's token id as JSON gives it: an integer (not a bool or a float), never negative.
PromptTokenId = Annotated[int, Strict(), Field(ge=0)]


class CompletionRequest(SamplingFields):
    # A string, a list of strings, token ids, or a list of token-id lists; normalized to a list (below).
    # pydantic's core checks the shape straight from the JSON: an agent's 33K-token prompt's body parses in
    # 2.0 ms (CPU, heap frozen: server/heap_freeze.py), where a check of each id in Python took 4.1 ms.
    prompt: str | list[PromptTokenId] | list[str] | list[list[PromptTokenId]] = Field(
        union_mode="left_to_right"
    )
    max_tokens: int | None = Field(None, ge=1)  # OpenAI's default for completions is 16
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None  # fill in the middle (server/prepare.py): models with FIM tokens
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # candidates per prompt; the n most likely return

    # What a field's value must be where it matched none of its union's shapes (`parse_body`).
    SHAPES: ClassVar[dict[str, str]] = {
        "prompt": "must be a string, a list of strings, a list of token ids, or a list of token-id lists"
    }

    @field_validator("prompt")
    @classmethod
    def _prompt_list(cls, value: Any, info: ValidationInfo) -> list[str | list[int]]:
        if isinstance(value, str):
            value = [value]
        elif not value or (isinstance(value[0], list) and not all(value)):  # no prompt, or a list of no ids
            raise ValueError("must not be empty")
        elif isinstance(value[0], int):
            value = [value]
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(value)}")
        n = info.data.get("n", 1)  # validated before prompt (declared first); absent when it was invalid
        if n * len(value) > MAX_CHOICES:
            raise ValueError(f"n x prompts may be at most {MAX_CHOICES}, got {n} x {len(value)}")
        return value

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if self.candidates * len(self.prompt) > MAX_CHOICES:
            raise APIError(
                400,
                f"best_of x prompts may be at most {MAX_CHOICES}, got {self.candidates} x {len(self.prompt)}",
                param="best_of",
            )
        if self.stream and self.best_of not in (None, self.n):
            raise APIError(400, "best_of cannot be used with stream", param="best_of")
        if self.suffix and self.echo:
            raise APIError(400, "suffix cannot be used with echo", param="suffix")

    @property
    def candidates(self) -> int:
        """Engine requests per prompt: best_of, else n."""
        return self.best_of or self.n


class TokenizeRequest(_Body):
    """Either `prompt` (plain text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_INT32)]]


def parse_body(body: bytes, model: type[_Model]) -> _Model:
    """Validates a JSON body; any problem is an HTTP 400 naming the field."""
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as error:
        raise _as_api_error(error, getattr(model, "SHAPES", {})) from None
    check = getattr(parsed, "check", None)
    if check is not None:
        check()
    return parsed


def _as_api_error(error: ValidationError, shapes: dict[str, str]) -> APIError:
    first = error.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    field = first["loc"][0] if first["loc"] else None
    if field in shapes and first["type"] not in ("value_error", "missing"):
        # A union's value that matched none of its shapes: the first error names one shape's complaint.
        value = _short(_field_input(error, str(field)))
        return APIError(400, f"{field}: {shapes[str(field)]} (got {value})", param=str(field))
    param = _param_path(first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = "this field is required"
    elif "input" in first and first["type"] not in ("value_error",):
        message += f" (got {_short(first['input'])})"
    if not param:  # a rule across fields (a model validator) has no one field to name
        return APIError(400, message)
    return APIError(400, f"{param}: {message}", param=param)


def _field_input(error: ValidationError, field: str) -> Any:
    """The value the body gave `field`: the input of an error at the field itself, else of the first one."""
    errors = error.errors(include_url=False)
    at_field = [e for e in errors if len(e["loc"]) == 2 and e["loc"][0] == field]  # loc: (field, union tag)
    return (at_field or errors)[0].get("input")


def _param_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
