"""Structured output: which grammar a request is constrained to, compiled off the event loop.

`response_format` (`json_object`, `json_schema`; chat), the extensions other servers take (SGLang's
`regex` and `ebnf`, vLLM's `structured_outputs` with `json` / `regex` / `choice` / `grammar` /
`json_object`, and its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`), and forced
tool calls (`tool_choice: "required"` or a named function: the tool parser's own call syntax, so that even
a tiny model writes a call the parser reads) become one `GrammarSpec`; a worker thread compiles it with a
cache keyed by the spec, and the engine receives the compiled grammar. Grammars are xgrammar's EBNF.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import NamedTuple

from morion.engine.grammar import CompiledGrammar, GrammarCompilerCache, GrammarError, GrammarSpec
from morion.server.errors import APIError
from morion.server.parsers.tool_calls import ToolCallParser
from morion.server.protocol import ChatCompletionRequest, NamedToolChoice, SamplingFields
from morion.text.tokenizer import Tokenizer


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
    """The front end's grammar compiler: built on first use (importing xgrammar takes about a second),
    compiling in a worker thread so that the event loop keeps serving."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._cache: GrammarCompilerCache | None = None
        self._lock = threading.Lock()

    async def compile(self, constraint: Constraint) -> CompiledGrammar:
        if self._tokenizer is None:
            raise APIError(
                400, "structured output needs a tokenizer, and this model has none", constraint.param
            )
        try:
            return await asyncio.to_thread(self._compile, constraint.spec)
        except GrammarError as error:
            raise APIError(400, f"{constraint.param}: {error}", param=constraint.param) from None

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._lock:
            if self._cache is None:
                assert self._tokenizer is not None
                self._cache = GrammarCompilerCache(self._tokenizer, self._vocab_size)
        return self._cache.compile(spec)
