"""Tools and reasoning on the way in (what the chat template sees) and out (which parsers read the answer).

A template that knows tools (it mentions `tools`) renders them itself; for one that does not, such as the
default model's, the tools are described in a system message in the tool parser's syntax, and earlier
calls and results in the history are written as that syntax too, so any chat model can be given tools.
"""

from __future__ import annotations

import json
from typing import Any

from morion.server.errors import APIError
from morion.server.parsers.chat_output import ChatOutputParser
from morion.server.parsers.reasoning import REASONING_PARSERS, prompt_opens_reasoning
from morion.server.parsers.tool_calls import TOOL_CALL_PARSERS, ToolCallParser
from morion.server.protocol import ChatCompletionRequest, NamedToolChoice
from morion.text.tokenizer import Tokenizer

_TOOLS_PROMPT = """You can call functions to help with the user's request. The functions are:
{functions}
To call a function, answer with only the call, written exactly like this:
{example}"""


def default_tool_parser(template_source: str | None) -> str:
    """The parser whose syntax the chat template teaches (Qwen3-Coder's XML), else Hermes JSON."""
    return "qwen3_coder" if template_source and "<function=" in template_source else "hermes"


class ChatTooling:
    """The server's tool and reasoning parsers, and what they mean for each chat request."""

    def __init__(self, tokenizer: Tokenizer | None, tool_parser: str | None, reasoning_parser: str | None):
        template = tokenizer.chat_template.source if tokenizer and tokenizer.chat_template else None
        self.tool_parser_name = tool_parser or default_tool_parser(template)
        self.tool_parser: type[ToolCallParser] = TOOL_CALL_PARSERS[self.tool_parser_name]
        self.reasoning_parser_name = reasoning_parser
        self.reasoning_parser = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
        self._template_knows_tools = template is not None and "tools" in template
        self._template_knows_calls = template is not None and "tool_calls" in template

    def describe(self) -> dict[str, Any]:
        """What `/v1/server_info` reports of the agent features (the parsers after their defaults)."""
        return {
            "tool_call_parser": self.tool_parser_name,
            "reasoning_parser": self.reasoning_parser_name,
            "structured_output": ["json_object", "json_schema", "regex", "ebnf", "choice"],
        }

    def check(self, request: ChatCompletionRequest) -> None:
        """A named tool_choice must name one of the tools."""
        choice = request.tool_choice
        if choice == "required" and not request.tools:
            raise APIError(400, 'tool_choice "required" needs tools', param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            names = [tool.function.name for tool in request.tools or ()]
            if choice.function.name not in names:
                raise APIError(
                    400,
                    f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                    f"({', '.join(map(repr, names)) or 'none given'})",
                    param="tool_choice",
                )

    def template_inputs(
        self, request: ChatCompletionRequest
    ) -> tuple[list[dict[str, Any]], list[Any] | None]:
        """The messages and tools to render. With tool_choice "none" the model is not shown the tools."""
        messages = [message.for_template() for message in request.messages]
        tools = (
            [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools_enabled else None
        )
        if not self._template_knows_calls:
            messages = [self._as_plain_turn(message) for message in messages]
        if tools and not self._template_knows_tools:
            messages = self._with_tools_prompt(messages, tools)
            tools = None
        return messages, tools

    def output_parser(
        self, request: ChatCompletionRequest, prompt: str, constrained: bool
    ) -> ChatOutputParser | None:
        """A new parser for one choice of `request` (None: the text is all content)."""
        tools = None
        if request.tools_enabled:
            tools = self.tool_parser({t.function.name: t.function.parameters for t in request.tools or ()})
        reasoning = None
        thinking = (request.chat_template_kwargs or {}).get("enable_thinking", True)
        if self.reasoning_parser is not None and thinking is not False and not constrained:
            starts = tools.start_markers if tools else ()
            reasoning = self.reasoning_parser(prompt_opens_reasoning(prompt), starts)
        if tools is None and reasoning is None:
            return None
        return ChatOutputParser(reasoning, tools)

    def _as_plain_turn(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("tool_calls"):
            calls = [self.tool_parser.format_call(c["function"]["name"], c["function"]["arguments"])
                     for c in message["tool_calls"]]  # fmt: skip
            text = "\n".join([message["content"], *calls] if message["content"] else calls)
            return {"role": "assistant", "content": text}
        if message["role"] == "tool":
            return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        return message

    def _with_tools_prompt(self, messages: list[dict[str, Any]], tools: list[Any]) -> list[dict[str, Any]]:
        functions = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
        example = self.tool_parser.format_call("function_name", {"argument": "value"})
        prompt = _TOOLS_PROMPT.format(functions=functions, example=example)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]
