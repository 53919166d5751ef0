"""`tools`: tool calling against local deterministic mock tools, graded exactly.

A probe first: a server that rejects `tools` (400/422) is reported "unsupported" and no case runs; one that
takes tools but answers the probe (an explicit request to call a tool) without a tool call fails (tool
calling is offered and does not work with this model), and no case runs either. Otherwise each case runs up
to `max_turns` model turns: every tool call is answered by the mock (the case file's fixed result for those
exact arguments; anything else gets an error result), and the conversation continues until the model
answers without a call. Pass: the calls made equal the expected calls exactly (names, order and JSON
arguments, parsed and compared as values), every argument string parsed as JSON, and the final answer
contains the expected strings (pennyroyal-runtime.md §2.2).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx

from morion.validate import cases as case_files
from morion.validate.chat import ChatReply
from morion.validate.session import Session
from morion.validate.streaming import RequestFailed


class MockTools:
    """Deterministic results keyed by tool name and canonical JSON arguments."""

    def __init__(self, responses: list[dict[str, Any]]) -> None:
        self._results = {_key(r["name"], r["arguments"]): r["result"] for r in responses}

    def call(self, name: str, arguments: Any) -> dict[str, Any]:
        result = self._results.get(_key(name, arguments))
        if result is None:
            return {"error": f"no such record for {name} with arguments {json.dumps(arguments)}"}
        return result


def _key(name: str, arguments: Any) -> str:
    return name + ":" + json.dumps(arguments, sort_keys=True, separators=(",", ":"))


def run(session: Session) -> dict[str, Any]:
    case_file = case_files.load("tools")
    data = case_file.data
    header = {"case_file": case_file.identity()}
    try:
        probe = session.chat.ask(data["probe"]["messages"], data["max_tokens"], tools=data["tools"])
    except RequestFailed as rejected:
        if rejected.status in (400, 422):
            session.say(f"tools: unsupported (the server rejects tools: HTTP {rejected.status})")
            return {**header, "verdict": "unsupported", "reason": f"the server rejects tools: {rejected}"}
        return {**header, "verdict": "fail", "reason": f"probe failed: {rejected}"}
    except httpx.HTTPError as error:
        return {**header, "verdict": "fail", "reason": f"probe failed: {error or type(error).__name__}"}
    if not probe.tool_calls:
        reason = "the server accepted tools but the model answered the probe without a tool call"
        session.say(f"tools: FAIL ({reason})")
        return {**header, "verdict": "fail", "reason": reason, "probe": probe.evidence()}
    mocks = MockTools(data["responses"])
    results = []
    for case in case_files.select(data["cases"], session.options.cases):
        result = _run_case(session, data, case, mocks)
        session.say(f"tools {case['id']}: {result['verdict']} {result['reason']}")
        results.append(result)
    passed = sum(r["verdict"] == "pass" for r in results)
    return {
        **header,
        "verdict": "pass" if results and passed == len(results) else "fail",
        "probe": probe.evidence(),
        "cases": results,
        "figures": {
            "passed": passed,
            "cases": len(results),
            "exact_calls": sum(r["exact_calls"] for r in results),
            "arguments_parsed": sum(r["arguments_parsed"] for r in results),
        },
    }


def _run_case(
    session: Session, data: dict[str, Any], case: dict[str, Any], mocks: MockTools
) -> dict[str, Any]:
    messages = copy.deepcopy(case["messages"])
    made: list[dict[str, Any]] = []
    replies: list[dict[str, Any]] = []
    final: str | None = None
    error = None
    for _ in range(data["max_turns"]):
        try:
            reply = session.chat.ask(messages, data["max_tokens"], tools=data["tools"])
        except (httpx.HTTPError, RequestFailed) as failure:
            error = str(failure) or type(failure).__name__
            break
        replies.append(reply.evidence())
        if not reply.tool_calls:
            final = reply.content
            break
        messages += _answer_calls(reply, mocks, made)
    parsed = all(call["parsed"] for call in made)
    got = [{"name": call["name"], "arguments": call["arguments"]} for call in made]
    exact = got == case["expected_calls"]
    missing = [text for text in case["final_contains"] if final is None or text not in final]
    problems = []
    if error:
        problems.append(f"request failed: {error}")
    elif final is None:
        problems.append(f"no final answer within {data['max_turns']} turns")
    if not parsed:
        problems.append("arguments that are not JSON")
    if not exact:
        problems.append(f"calls {json.dumps(got)} != expected {json.dumps(case['expected_calls'])}")
    if missing:
        problems.append(f"final answer lacks {missing}")
    return {
        "id": case["id"],
        "verdict": "fail" if problems else "pass",
        "reason": "; ".join(problems),
        "exact_calls": exact,
        "arguments_parsed": parsed,
        "calls": made,
        "final": final,
        "turns": replies,
    }


def _answer_calls(reply: ChatReply, mocks: MockTools, made: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The assistant turn with its calls, then one tool message per call with the mock's result."""
    calls = []
    results = []
    for index, call in enumerate(reply.tool_calls):
        call_id = call["id"] or f"call_{len(made) + index}"
        try:
            arguments, parsed = json.loads(call["arguments"] or "{}"), True
        except ValueError:
            arguments, parsed = call["arguments"], False
        made.append({"name": call["name"], "arguments": arguments, "parsed": parsed})
        result = mocks.call(call["name"], arguments) if parsed else {"error": "arguments are not valid JSON"}
        calls.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
        )
        results.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)})
    return [{"role": "assistant", "content": reply.content or None, "tool_calls": calls}, *results]
