"""The OpenAI protocol details that peer servers' own suites check, against a real `morion serve` driven
by the official `openai` client: model retrieval, error shapes, `stream_options`, logprobs (the chosen
token always among `top_logprobs` for completions), `echo`, `logit_bias`, `best_of`, `suffix`, structured
output through `extra_body`, `continue_final_message`, `return_token_ids`, `prompt_logprobs`, tool-call
arguments streamed piece by piece, and the request log."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer as FastTokenizer
from tokenizers.models import WordLevel

from morion.server.engine_messages import RequestDelta
from morion.server.parsers.chat_output import ChatOutputParser
from morion.server.parsers.reasoning import Qwen3ReasoningParser
from morion.server.prepare import fill_in_the_middle
from morion.server.responses import ChatFormat, TokenTexts
from morion.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "Say hello."}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def _rejected(server, **fields) -> dict:
    """The error body of a chat request the server must refuse with a 400."""
    with pytest.raises(openai.BadRequestError) as raised:
        server.openai().chat.completions.create(
            **({"model": "smollm2", "messages": HELLO, "max_tokens": 2} | fields)
        )
    return raised.value.body


def _tokens(server, **body) -> list[int]:
    with server.http() as http:
        return http.post("/tokenize", json=body).json()["tokens"]


def test_models_retrieve_and_unknown_routes(server):
    client = server.openai()
    model = client.models.retrieve("smollm2")
    assert model.id == "smollm2" and model.object == "model" and model.model_extra["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.body["code"] == "model_not_found"
    with server.http() as http:
        for method, path in [("POST", "/v1/embeddings"), ("POST", "/v1/chat/completions/"), ("GET", "/")]:
            response = http.request(method, path, json={})
            assert response.status_code == 404, (method, path)
            error = response.json()["error"]
            assert error["type"] == "not_found_error" and path in error["message"]
        wrong_method = http.delete("/v1/models")
        assert wrong_method.status_code == 405 and wrong_method.json()["error"]["message"]


def test_stream_options_needs_stream(server):
    assert _rejected(server, stream_options={"include_usage": True})["param"] == "stream_options"


def test_completion_top_logprobs_hold_the_chosen_token(server):
    client = server.openai()
    sampled = client.completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5, logprobs=2
    )
    logprobs = sampled.choices[0].logprobs
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert top[token] == pytest.approx(logprob)  # the sampled token, even where it is not in the top 2
        assert 2 <= len(top) <= 3
    alone = client.completions.create(
        model="smollm2", prompt="One, two,", max_tokens=3, temperature=0, logprobs=0
    )
    entries = alone.choices[0].logprobs
    assert [list(top) for top in entries.top_logprobs] == [[token] for token in entries.tokens]


def test_chat_top_logprobs_are_the_most_likely_in_order(server):
    chat = server.openai().chat.completions.create(
        model="smollm2", messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=4
    )
    for entry in chat.choices[0].logprobs.content:
        values = [alternative.logprob for alternative in entry.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert entry.token == entry.top_logprobs[0].token  # greedy: the chosen token is the most likely
    none = server.openai().chat.completions.create(
        model="smollm2", messages=HELLO, max_tokens=2, temperature=0, logprobs=True, top_logprobs=0
    )
    assert all(entry.top_logprobs == [] for entry in none.choices[0].logprobs.content)


def test_echo_puts_the_prompt_first_with_its_logprobs(server):
    prompt = "The capital of France is"
    completion = server.openai().completions.create(
        model="smollm2", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    choice = completion.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    logprobs = choice.logprobs
    prompt_tokens = len(_tokens(server, prompt=prompt))
    assert len(logprobs.tokens) == prompt_tokens + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(isinstance(lp, float) for lp in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    chat = server.openai().chat.completions.create(
        model="smollm2",
        messages=[*HELLO, {"role": "assistant", "content": "Hello! I am"}],
        max_tokens=4,
        temperature=0,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert chat.choices[0].message.content.startswith("Hello! I am")


def test_logit_bias_bans_and_forces(server):
    client = server.openai()
    free = client.completions.create(model="smollm2", prompt="One, two,", max_tokens=1, temperature=0)
    [first] = (
        client.completions.create(
            model="smollm2",
            prompt="One, two,",
            max_tokens=1,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        .choices[0]
        .model_extra["token_ids"]
    )
    banned = client.completions.create(
        model="smollm2", prompt="One, two,", max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != free.choices[0].text
    forced_id = _tokens(server, prompt=" banana")[0]
    forced = client.chat.completions.create(
        model="smollm2",
        messages=HELLO,
        max_tokens=3,
        temperature=0.7,
        seed=1,
        logit_bias={str(forced_id): 100},
    )
    assert forced.choices[0].message.content.startswith(" banana banana")
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="smollm2", prompt="x", max_tokens=1, logit_bias={"7": 200})
    assert raised.value.body["param"] == "logit_bias"


def test_best_of_returns_the_most_likely_candidate(server):
    client = server.openai()
    common = {"model": "smollm2", "prompt": "My favourite food is", "max_tokens": 5, "temperature": 1.0}
    common |= {"seed": 11, "extra_body": {"ignore_eos": True}}
    every = client.completions.create(n=3, best_of=3, logprobs=0, **common)
    totals = [sum(choice.logprobs.token_logprobs) for choice in every.choices]
    best = client.completions.create(n=1, best_of=3, **common)
    assert [choice.text for choice in best.choices] == [every.choices[totals.index(max(totals))].text]
    assert best.choices[0].logprobs is None  # asked for none
    assert best.usage.completion_tokens == 15  # every candidate's tokens count
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(n=2, best_of=1, **common)
    assert raised.value.body["param"] == "best_of"


def test_suffix_needs_fill_in_the_middle_tokens(server):
    with pytest.raises(openai.BadRequestError) as raised:
        server.openai().completions.create(model="smollm2", prompt="def f(", suffix="):\n", max_tokens=4)
    assert raised.value.body["param"] == "suffix" and "fill-in-the-middle" in raised.value.body["message"]


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["yes", "no", "maybe"]}, lambda text: text in ("yes", "no", "maybe")),
        ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda text: text in ("red", "blue")),
        ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
        ({"structured_outputs": {"regex": r"(ab){1,3}c"}}, lambda text: re.fullmatch(r"(ab){1,3}c", text)),
        ({"ebnf": 'root ::= "x" [0-9] [0-9]'}, lambda text: re.fullmatch(r"x[0-9]{2}", text)),
        ({"guided_grammar": 'root ::= "ok" | "no"'}, lambda text: text in ("ok", "no")),
        ({"guided_json": CITY}, lambda text: jsonschema.validate(json.loads(text), CITY) is None),
        (
            {"structured_outputs": {"json": CITY}},
            lambda text: jsonschema.validate(json.loads(text), CITY) is None,
        ),
        ({"structured_outputs": {"json_object": True}}, lambda text: isinstance(json.loads(text), dict)),
    ],
)
def test_structured_output_through_extra_body(server, extra, check):
    client = server.openai()
    chat = client.chat.completions.create(
        model="smollm2", messages=HELLO, max_tokens=120, temperature=0, extra_body=extra
    )
    assert chat.choices[0].finish_reason == "stop" and check(chat.choices[0].message.content)
    text = client.completions.create(
        model="smollm2", prompt="Answer:", max_tokens=120, temperature=0.8, seed=4, extra_body=extra
    )
    assert text.choices[0].finish_reason == "stop" and check(text.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"min_tokens": 4}, "min_tokens"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"structural_tag": {"type": "structural_tag"}}, "structural_tag"),
        (
            {"guided_choice": ["a"], "guided_regex": "b"},
            "guided_choice",
        ),  # two constraints: the second is named
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ],
)
def test_output_changing_fields_are_never_ignored(server, extra, param):
    assert _rejected(server, extra_body=extra)["param"] == param
    neutral = server.openai().chat.completions.create(
        model="smollm2",
        messages=HELLO,
        max_tokens=2,
        extra_body={"min_tokens": 0, "skip_special_tokens": True},
    )
    assert neutral.choices[0].message.content is not None


def test_continue_final_message_continues_it(server):
    messages = [*HELLO, {"role": "assistant", "content": "Hello there, my friend"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    with server.http() as http:
        rendered = http.post("/v1/chat/completions/render", json={"messages": messages, **extra}).json()
    assert rendered["prompt"].endswith("Hello there, my friend")
    chat = server.openai().chat.completions.create(
        model="smollm2", messages=messages, max_tokens=3, temperature=0, extra_body=extra
    )
    assert chat.usage.prompt_tokens == rendered["count"]
    assert _rejected(server, extra_body={"continue_final_message": True})["param"] == "continue_final_message"


def test_return_token_ids_and_prompt_logprobs(server):
    client = server.openai()
    chat = client.chat.completions.create(
        model="smollm2",
        messages=HELLO,
        max_tokens=5,
        temperature=0,
        extra_body={"return_token_ids": True, "prompt_logprobs": 2},
    )
    prompt_ids = chat.model_extra["prompt_token_ids"]
    assert prompt_ids == _tokens(server, messages=HELLO)
    token_ids = chat.choices[0].model_extra["token_ids"]
    assert len(token_ids) == chat.usage.completion_tokens
    with server.http() as http:
        decoded = http.post("/detokenize", json={"tokens": token_ids}).json()["prompt"]
    assert decoded.startswith(chat.choices[0].message.content)
    prompt_logprobs = chat.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for token, entry in zip(prompt_ids[1:], prompt_logprobs[1:], strict=True):
        own = entry[str(token)]
        assert own["logprob"] <= 0 and own["rank"] >= 1 and len(entry) <= 3
    stream = {"stream": True, "extra_body": {"return_token_ids": True}}
    streamed = client.completions.create(model="smollm2", prompt="Hi", max_tokens=3, temperature=0, **stream)
    chunks = [chunk.choices[0].model_extra for chunk in streamed if chunk.choices]
    assert chunks[0]["prompt_token_ids"] == _tokens(server, prompt="Hi")
    assert sum(len(chunk.get("token_ids") or []) for chunk in chunks) == 3


def test_stop_reason_names_the_stop_string(server):
    client = server.openai()
    free = client.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=6, temperature=0)
    stop = free.choices[0].text.split(",")[1] + ","
    stopped = client.completions.create(
        model="smollm2", prompt="1, 2, 3,", max_tokens=6, temperature=0, stop=[stop]
    )
    assert (
        stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_extra["stop_reason"] == stop
    )


def test_tool_call_arguments_stream_piece_by_piece(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    stream = server.openai().chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
        tools=tools,
        tool_choice="required",
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    pieces = [call for chunk in stream for choice in chunk.choices for call in choice.delta.tool_calls or ()]
    assert pieces[0].id and pieces[0].function.name == "get_weather" and pieces[0].type == "function"
    assert all(piece.index == 0 and piece.id is None for piece in pieces[1:])
    arguments = [piece.function.arguments for piece in pieces if piece.function.arguments]
    assert len(arguments) > 2  # not one delta at the end of the call
    jsonschema.validate(json.loads("".join(arguments)), CITY)


def test_request_log_has_one_line_per_request(server):
    client = server.openai()
    client.completions.create(model="smollm2", prompt="Log me", max_tokens=2, temperature=0)
    with server.http() as http:
        http.get("/v1/nothing")
    log = server.log_once_it_has("morion: GET /v1/nothing 404 duration=")
    line = next(line for line in reversed(log.splitlines()) if "POST /v1/completions 200" in line)
    assert re.search(r"prompt=\d+ cached=\d+ completion=2 ttft=\d+\.\d+s duration=\d+\.\d+s$", line), line
    assert "morion: GET /v1/nothing 404 duration=" in log


def test_reasoning_is_sent_under_both_names():
    def reasoning_format() -> ChatFormat:
        parser = lambda: ChatOutputParser(Qwen3ReasoningParser(), None)  # noqa: E731
        return ChatFormat("id", "m", TokenTexts(None), False, parser, reasoning=True)

    streamed = reasoning_format()
    choice = streamed.new_choice()
    entry = streamed.delta_choice(0, RequestDelta("r", [1], "<think>plan</think>Hi", None, None), choice)
    assert entry["delta"]["reasoning_content"] == entry["delta"]["reasoning"] == "plan"
    whole = reasoning_format()
    choice = whole.new_choice()
    choice.add("<think>plan</think>Hi")
    message = whole.final_choice(0, choice)["message"]
    assert message["reasoning_content"] == message["reasoning"] == "plan" and message["content"] == "Hi"


def test_fill_in_the_middle_prompt_of_a_model_with_fim_tokens():
    words = ["<unk>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    tokenizer = Tokenizer(
        FastTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")), [0]
    )
    prompt = fill_in_the_middle(tokenizer, "def f(", "):")
    assert prompt == "<|fim_prefix|>def f(<|fim_suffix|>):<|fim_middle|>"
