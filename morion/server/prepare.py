"""From a validated request to engine work: prompt token ids, token budgets and sampling parameters.

Everything the engine would reject is rejected here first, with the field named, so that a stream never
starts for a request that cannot run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from morion.engine.grammar import CompiledGrammar
from morion.engine.sampling_params import SamplingParams
from morion.errors import InvalidRequestError
from morion.multimodal.image_decode import PreparedImage
from morion.server.engine_messages import EngineInfo
from morion.server.errors import APIError
from morion.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from morion.text.tokenizer import Tokenizer

_SEED_SPACE = 2**64
# Arguments of ChatTemplate.render; a template kwarg of the same name would collide with them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"}
)
# OpenAI's default max_tokens for /v1/completions; chat completions default to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class EngineJob(NamedTuple):
    """One HTTP request's engine requests. Choice i runs prompts[i // n] with params[i]; a chat's one
    prompt may hold `images`' tokens."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    n: int
    images: tuple[PreparedImage, ...] = ()

    def submissions(self) -> list[tuple[list[int], SamplingParams, tuple[PreparedImage, ...]]]:
        return [(self.prompts[i // self.n], params, self.images) for i, params in enumerate(self.params)]


class RenderedChat(NamedTuple):
    text: str
    token_ids: list[int]


def check_model(requested: str | None, served_names: Sequence[str]) -> None:
    if requested is not None and requested not in served_names:
        raise APIError(
            404,
            f"the model {requested!r} does not exist; this server serves {served_names[0]!r}",
            param="model",
            code="model_not_found",
        )


def render_chat(
    tokenizer: Tokenizer | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
    tools: list[Any] | None = None,
    continue_final_message: bool = False,
) -> RenderedChat:
    """`messages` as `ChatMessage.for_template` gives them; `tools` for templates that render them.

    `continue_final_message`: the prompt ends inside the last (assistant) message, right after its text,
    so that the answer continues it (the template's end-of-turn after it is cut off)."""
    if tokenizer is None:
        raise APIError(
            400,
            "this model has no tokenizer (random weights of a preset, or a directory without one), so it "
            "cannot render chat messages: send token ids as the prompt of /v1/completions",
            param="messages",
        )
    if tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template; send a prompt to /v1/completions instead")
    kwargs = template_kwargs or {}
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {reserved[0]!r}", param="chat_template_kwargs")
    try:
        text = tokenizer.render_chat(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
    except InvalidRequestError as error:
        raise APIError(400, str(error), param="messages") from None
    if continue_final_message:
        text = _open_final_message(text, messages[-1]["content"])
    # The template writes BOS itself where the model wants one (as Tokenizer.encode_chat).
    return RenderedChat(text, tokenizer.encode(text, add_special_tokens=False))


def _open_final_message(text: str, final: str) -> str:
    end = text.rfind(final.rstrip()) if final.strip() else -1
    if end < 0:
        raise APIError(
            400,
            "continue_final_message: the chat template does not show the last message's text as it is",
            param="continue_final_message",
        )
    return text[: end + len(final.rstrip())]


def chat_echo(request: ChatCompletionRequest) -> str:
    """With `echo`, the answer starts with the last message's text when that message is the assistant's
    (the one `continue_final_message` continues), as vLLM does."""
    last = request.messages[-1]
    return (last.content or "") if request.echo and last.role == "assistant" else ""


def chat_job(
    request: ChatCompletionRequest,
    prompt: list[int],
    info: EngineInfo,
    grammar: CompiledGrammar | None = None,
) -> EngineJob:
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
    check_vocabulary(request.stop_token_ids or (), info, "stop_token_ids")
    check_prompt_fits(prompt, info, "messages")
    if request.max_completion_tokens is not None:
        requested, name = request.max_completion_tokens, "max_completion_tokens"
    else:
        requested, name = request.max_tokens, "max_tokens"
    budget = token_budget(requested, name, len(prompt), info.max_model_len, default=None)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = sampling_params(request, budget, logprobs, grammar, request.prompt_logprobs)
    return EngineJob([prompt], params, request.n)


def completion_job(
    request: CompletionRequest,
    tokenizer: Tokenizer | None,
    info: EngineInfo,
    grammar: CompiledGrammar | None = None,
) -> EngineJob:
    """`request.candidates` engine requests per prompt (best_of, else n). With best_of, every candidate
    reports its tokens' logprobs, by which the best n are chosen (responses.py)."""
    check_vocabulary(request.stop_token_ids or (), info, "stop_token_ids")
    prompts = [completion_prompt(p, tokenizer, info, request.suffix) for p in request.prompt]
    logprobs = request.logprobs
    if logprobs is None and request.candidates > request.n:
        logprobs = 0  # the chosen tokens' logprobs rank the candidates
    # echo with logprobs: the prompt's tokens have logprobs too (their first one none).
    prompt_logprobs = request.prompt_logprobs
    if request.echo and request.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
    params = []
    for prompt in prompts:
        budget = token_budget(
            request.max_tokens, "max_tokens", len(prompt), info.max_model_len, COMPLETIONS_DEFAULT_MAX_TOKENS
        )
        params += sampling_params(
            request, budget, logprobs, grammar, prompt_logprobs, candidates=request.candidates
        )
    return EngineJob(prompts, params, request.candidates)


# Fill-in-the-middle tokens of the families that have them, in prefix-suffix-middle order.
_FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
)


def fill_in_the_middle(tokenizer: Tokenizer, prompt: str, suffix: str) -> str:
    """The prompt of a `suffix` completion: the model writes what goes between prompt and suffix."""
    vocabulary = tokenizer.backend.get_vocab()
    for prefix_token, suffix_token, middle_token in _FIM_TOKENS:
        if all(token in vocabulary for token in (prefix_token, suffix_token, middle_token)):
            return f"{prefix_token}{prompt}{suffix_token}{suffix}{middle_token}"
    raise APIError(
        400, "suffix needs a model with fill-in-the-middle tokens, and this one has none", param="suffix"
    )


def completion_prompt(
    prompt: str | list[int], tokenizer: Tokenizer | None, info: EngineInfo, suffix: str | None = None
) -> list[int]:
    if suffix and not isinstance(prompt, str):
        raise APIError(400, "suffix needs a text prompt", param="suffix")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(
                400,
                "this model has no tokenizer (random weights of a preset, or a directory without one), so "
                "it cannot read text: send the prompt as token ids",
                param="prompt",
            )
        if suffix:
            prompt = fill_in_the_middle(tokenizer, prompt, suffix)
        token_ids = tokenizer.encode(prompt)
        if not token_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
    else:
        token_ids = prompt
        check_vocabulary(token_ids, info, "prompt")
    check_prompt_fits(token_ids, info, "prompt")
    return token_ids


def check_vocabulary(token_ids: Sequence[int], info: EngineInfo, param: str) -> None:
    bad = next((t for t in token_ids if t >= info.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {info.vocab_size})", param)


def check_prompt_fits(prompt: list[int], info: EngineInfo, param: str) -> None:
    # At least one token must be generated, so a prompt may take at most max_model_len - 1 tokens.
    if len(prompt) >= info.max_model_len:
        raise APIError(
            400,
            f"the prompt has {len(prompt)} tokens, but this server's context is {info.max_model_len} tokens "
            f"(at most {info.max_model_len - 1} prompt tokens fit)",
            param=param,
            code="context_length_exceeded",
        )


def token_budget(
    requested: int | None, name: str, prompt_len: int, max_model_len: int, default: int | None
) -> int:
    room = max_model_len - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(
            400,
            f"{name}={requested} does not fit: the context is {max_model_len} tokens and the prompt takes "
            f"{prompt_len}, so at most {room} tokens can be generated",
            param=name,
            code="context_length_exceeded",
        )
    return requested


def sampling_params(
    fields: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    grammar: CompiledGrammar | None = None,
    prompt_logprobs: int | None = None,
    candidates: int | None = None,
) -> list[SamplingParams]:
    """`candidates` (default n) parameter sets; with a seed, choice i samples with seed + i, so choices
    differ but reproduce."""
    count = candidates or fields.n
    options: dict[str, Any] = {
        "temperature": fields.temperature,
        "top_p": fields.top_p,
        "top_k": None if fields.top_k is None else max(fields.top_k, 0),
        "min_p": fields.min_p,
        "repetition_penalty": fields.repetition_penalty,
        "presence_penalty": fields.presence_penalty,
        "frequency_penalty": fields.frequency_penalty,
    }
    options = {name: value for name, value in options.items() if value is not None}
    seeds = [None] * count if fields.seed is None else [(fields.seed + i) % _SEED_SPACE for i in range(count)]
    try:
        return [
            SamplingParams(
                max_tokens=max_tokens,
                seed=seed,
                stop=tuple(fields.stop or ()),
                stop_token_ids=tuple(fields.stop_token_ids or ()),
                ignore_eos=fields.ignore_eos,
                logprobs=logprobs,
                grammar=grammar,
                logit_bias=fields.token_bias,
                prompt_logprobs=prompt_logprobs,
                cache_salt=fields.cache_salt,
                **options,
            )
            for seed in seeds
        ]
    except InvalidRequestError as error:
        raise APIError(400, str(error)) from None
