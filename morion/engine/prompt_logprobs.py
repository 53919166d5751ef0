"""Logprobs of a request's prompt tokens (`SamplingParams.prompt_logprobs`), from a prefill chunk's
hidden states."""

from __future__ import annotations

import torch

from morion.engine.outputs import PromptLogprob
from morion.engine.request import Request
from morion.runner.model_runner import Forward, ModelRunner

_PROMPT_LOGPROB_ROWS = 256  # prompt rows turned into logits at once (a [rows, vocab] fp32 temporary)


def record_prompt_logprobs(
    runner: ModelRunner, forward: Forward, request: Request, start: int, length: int
) -> None:
    """Logprobs of the prompt tokens this chunk's rows (`start`, `length` rows of `forward`) predict (row
    j predicts the token after it), from the raw logits as for generated tokens; the logits are made a
    slice of rows at a time, through the runner (at tensor parallelism every rank takes part)."""
    first = request.num_computed
    # The last prompt row predicts the first output token, not a prompt token.
    rows = min(length, len(request.prompt_token_ids) - 1 - first)
    top_n = request.params.prompt_logprobs
    for offset in range(0, rows, _PROMPT_LOGPROB_ROWS):
        count = min(_PROMPT_LOGPROB_ROWS, rows - offset)
        row_ids = list(range(start + offset, start + offset + count))
        logprobs = runner.logits(forward, row_ids).log_softmax(dim=-1)
        targets = torch.tensor(request.prompt_token_ids[first + offset + 1 : first + offset + 1 + count])
        chosen = logprobs.gather(1, targets.to(logprobs.device).unsqueeze(1))
        ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        chosen = chosen.squeeze(1).tolist()
        values, ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
        for j in range(count):
            top = list(zip(ids[j].tolist(), values[j].tolist(), strict=True)) if top_n else []
            request.prompt_logprobs[first + offset + 1 + j] = PromptLogprob(chosen[j], ranks[j], top)
