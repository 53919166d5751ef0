"""Structured output: which grammar a request is constrained to, compiled off the event loop.

`response_format` (`json_object`, `json_schema`; chat, and the Responses API's `text.format`), the
extensions other servers take (SGLang's `regex` and `ebnf`, vLLM's `structured_outputs` with `json` /
`regex` / `choice` / `grammar` / `json_object`, and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`), and forced tool calls (`tool_choice: "required"` or a named function,
also the Messages API's `any` and `tool`: the tool parser's own call syntax, so that even a tiny model
writes a call the parser reads) become one `GrammarSpec`. Whatever its source, a child process compiles
it, bounded in source size, time, memory and result size (`grammar_worker.py`), with a cache keyed by the
spec, and the engine receives the compiled grammar. A grammar past a bound is a 400 naming the field.
Grammars are xgrammar's EBNF.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from morion.engine.grammar import CompiledGrammar, GrammarError, GrammarLRU, GrammarSpec, tokenizer_info
from morion.server.errors import APIError
from morion.server.grammar_worker import GrammarWorker
from morion.server.options import MAX_GRAMMAR_SOURCE_BYTES
from morion.server.parsers.tool_calls import ToolCallParser
from morion.server.protocol import ChatCompletionRequest, NamedToolChoice, SamplingFields
from morion.text.tokenizer import Tokenizer

_MAX_WAITING = 16  # compilations queued behind the one running; more are refused (503) until some finish


class Constraint(NamedTuple):
    spec: GrammarSpec
    param: str  # the request field the grammar comes from, named in a 400


def chat_constraint(request: ChatCompletionRequest, tool_parser: type[ToolCallParser]) -> Constraint | None:
    """The grammar a chat request asks for, or None; conflicting constraints are a 400."""
    constraints = []
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        constraints.append(Constraint(GrammarSpec("json_object"), "response_format"))
    elif response_format is not None and response_format.json_schema is not None:
        schema = json.dumps(response_format.json_schema.schema_)
        constraints.append(
            Constraint(GrammarSpec("json_schema", schema), "response_format.json_schema.schema")
        )
    constraints += _extension_constraints(request)
    if request.tools and (
        request.tool_choice == "required" or isinstance(request.tool_choice, NamedToolChoice)
    ):
        constraints.append(Constraint(_forced_tool_calls(request, tool_parser), "tools"))
    return _one(constraints)


def completion_constraint(request: SamplingFields) -> Constraint | None:
    """The grammar a completion request asks for through the extensions, or None."""
    return _one(_extension_constraints(request))


def _extension_constraints(request: SamplingFields) -> list[Constraint]:
    found: list[Constraint] = []
    outputs = request.structured_outputs
    sources = [
        ("regex", "regex", request.regex),
        ("ebnf", "ebnf", request.ebnf),
        ("json_schema", "guided_json", request.guided_json),
        ("regex", "guided_regex", request.guided_regex),
        ("choice", "guided_choice", request.guided_choice),
        ("ebnf", "guided_grammar", request.guided_grammar),
    ]
    if outputs is not None:
        sources += [
            ("json_schema", "structured_outputs.json", outputs.json_),
            ("regex", "structured_outputs.regex", outputs.regex),
            ("choice", "structured_outputs.choice", outputs.choice),
            ("ebnf", "structured_outputs.grammar", outputs.grammar),
            ("json_object", "structured_outputs.json_object", outputs.json_object or None),
        ]
    for kind, param, value in sources:
        if value is None:
            continue
        if kind == "json_schema":
            spec = GrammarSpec("json_schema", value if isinstance(value, str) else json.dumps(value))
        elif kind == "choice":
            spec = GrammarSpec("ebnf", _choice_grammar(value, param))
        elif kind == "json_object":
            spec = GrammarSpec("json_object")
        else:
            spec = GrammarSpec(kind, value)
        found.append(Constraint(spec, param))
    if outputs is not None and not any(c.param.startswith("structured_outputs") for c in found):
        raise APIError(400, "structured_outputs names no constraint", param="structured_outputs")
    return found


def _choice_grammar(choices: list[str], param: str) -> str:
    """One of the strings, exactly: an EBNF alternation of string literals."""
    if not choices or not all(isinstance(choice, str) and choice for choice in choices):
        raise APIError(400, f"{param}: give a list of non-empty strings", param=param)
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _one(constraints: list[Constraint]) -> Constraint | None:
    if len(constraints) > 1:
        names = " and ".join(c.param.split(".")[0] for c in constraints)
        raise APIError(
            400, f"{names} cannot be combined: each constrains the whole output", constraints[1].param
        )
    return constraints[0] if constraints else None


def _forced_tool_calls(request: ChatCompletionRequest, tool_parser: type[ToolCallParser]) -> GrammarSpec:
    import xgrammar

    tools = []
    for tool in request.tools or ():
        function = tool.function.model_dump(exclude_none=True)
        # No parameters means no arguments: an empty object, not any JSON value.
        function.setdefault("parameters", {"type": "object", "properties": {}})
        tools.append({"type": "function", "function": function})
    choice = request.tool_choice
    named = isinstance(choice, NamedToolChoice)
    try:
        tag = xgrammar.get_builtin_structural_tag(
            tool_parser.structural_tag_model,
            tools,
            tool_choice=choice.model_dump() if named else "required",
            reasoning=False,
            max_whitespace_cnt=1,  # small models otherwise fill the arguments with whitespace
            parallel_tool_calls=False,
        )
    except (ValueError, RuntimeError) as error:  # pydantic's ValidationError is a ValueError
        raise APIError(400, f"tools: {str(error).splitlines()[0]}", param="tools") from None
    structural = json.loads(tag.model_dump_json())
    form = structural["format"]
    if form["type"] == "triggered_tags":
        # Exactly one call and no free text around it, which a small model may never end (nor a series
        # of calls): a forced choice yields one call, then the stop token.
        structural["format"] = {
            "type": "tags_with_separator",
            "tags": form["tags"],
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": True,
        }
    return GrammarSpec("structural_tag", json.dumps(structural))


class GrammarService:
    """The front end's grammars: a spec's source is bounded (`MAX_GRAMMAR_SOURCE_BYTES`), compiled by the
    bounded child process of `grammar_worker.py` (started on first use: importing xgrammar takes about a
    second) from a thread of its own, so that the event loop keeps serving and a slow compilation holds no
    thread other work needs, and cached by spec, bounded in entries and bytes."""

    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, timeout_s: float, memory_bytes: int
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._timeout_s = timeout_s
        self._memory_bytes = memory_bytes
        self._worker: GrammarWorker | None = None
        self._cache = GrammarLRU()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="morion-grammar")
        self._waiting = 0

    async def compile(self, constraint: Constraint) -> CompiledGrammar:
        param = constraint.param
        if self._tokenizer is None:
            raise APIError(400, "structured output needs a tokenizer, and this model has none", param)
        size = len(constraint.spec.source.encode())
        if size > MAX_GRAMMAR_SOURCE_BYTES:
            raise APIError(
                400, f"{param}: {size} bytes, over the limit of {MAX_GRAMMAR_SOURCE_BYTES} bytes", param=param
            )
        compiled = self._cache.get(constraint.spec.key)
        if compiled is not None:
            return compiled
        if self._waiting >= _MAX_WAITING:
            raise APIError(503, "too many grammars are waiting to be compiled; retry shortly", code="busy")
        self._waiting += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._thread, self._compile, constraint.spec)
        except GrammarError as error:
            raise APIError(400, f"{param}: {error}", param=param) from None
        finally:
            self._waiting -= 1

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        compiled = self._cache.get(spec.key)  # an earlier request in the queue may have compiled it
        if compiled is not None:
            return compiled
        if self._worker is None:
            assert self._tokenizer is not None
            info = tokenizer_info(self._tokenizer, self._vocab_size).serialize_json()
            self._worker = GrammarWorker(info, self._timeout_s, self._memory_bytes)
        compiled = CompiledGrammar(spec.key, self._worker.compile(spec))
        self._cache.put(spec.key, compiled, len(compiled.serialized))
        return compiled

    def close(self) -> None:
        """Stops the compiler child; a compilation in progress fails at once."""
        if self._worker is not None:
            self._worker.kill()  # the waiting thread sees the pipe close and returns
        self._thread.shutdown(wait=True, cancel_futures=True)
        if self._worker is not None:
            self._worker.close()

    def kill(self) -> None:
        """Kills the compiler child at once (a forced exit)."""
        if self._worker is not None:
            self._worker.kill()
