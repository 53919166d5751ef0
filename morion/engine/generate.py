"""Single-request generation with a contiguous K/V cache: the path of `morion generate`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from morion.cache.sequence_kv_cache import SequenceKVCache
from morion.engine.sampler import RequestSampler, sample
from morion.engine.sampling_params import SamplingParams
from morion.engine.stop import StopStringMatcher
from morion.errors import InvalidRequestError
from morion.models.llama import DenseForCausalLM
from morion.text.detokenizer import IncrementalDetokenizer
from morion.text.tokenizer import Tokenizer


class TextDelta(NamedTuple):
    text: str
    token_id: int | None  # None for the final flush of held-back text


@torch.inference_mode()
def generate_token_ids(
    model: DenseForCausalLM,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    eos_token_ids: Sequence[int],
) -> Iterator[int]:
    """Yields generated token ids; the last one yielded may be the EOS or stop token that ended it."""
    config = model.config
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty")
    if len(prompt_token_ids) >= config.max_position_embeddings:
        raise InvalidRequestError(
            f"prompt of {len(prompt_token_ids)} tokens does not fit the model's context of "
            f"{config.max_position_embeddings}"
        )
    max_new = min(params.max_tokens, config.max_position_embeddings - len(prompt_token_ids))
    embedding = model.model.embed_tokens.weight
    device = embedding.device
    cache = SequenceKVCache(
        config.num_layers,
        len(prompt_token_ids) + max_new,
        config.num_kv_heads,
        config.head_dim,
        embedding.dtype,
        device,
    )
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    sampler = RequestSampler(params, prompt_token_ids)
    input_ids = torch.tensor(prompt_token_ids, dtype=torch.long, device=device)
    for _ in range(max_new):
        positions = torch.arange(cache.num_cached, cache.num_cached + len(input_ids), device=device)
        cache.begin(len(input_ids))
        hidden = model(input_ids, positions, cache)
        cache.commit()
        token_id = sample(model.compute_logits(hidden[-1:]), [sampler]).token_ids[0]
        sampler.append(token_id)
        yield token_id
        if token_id in stop_ids:
            return
        input_ids = torch.tensor([token_id], dtype=torch.long, device=device)


def generate_text(
    model: DenseForCausalLM,
    tokenizer: Tokenizer,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
) -> Iterator[TextDelta]:
    """Streams decoded text, holding back what could still become a stop string."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
    stop = StopStringMatcher(params.stop)
    for token_id in generate_token_ids(model, prompt_token_ids, params, tokenizer.eos_token_ids):
        check = stop.feed(detokenizer.add(token_id))
        yield TextDelta(check.emit, token_id)
        if check.stopped:
            return
    yield TextDelta(stop.flush(), None)
