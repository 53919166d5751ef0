"""`python faulty_morion.py serve ...`: morion with two planted faults, for the failure tests.

In the engine, sampling raises for every batch that holds a request seeded `$MORION_FAULTY_SEED`, as an
unexpected error in one request's sampling would (the `top_k` >= 2**63 overflow of issue 21 was one). In
the front end, tokenizing the text `PLANTED_PROMPT` raises, as a bug in a route would. multiprocessing's
spawn start runs this script's top level in the engine process too (as `__mp_main__`, with the process's
name already set), so each process gets its patch; the front end does not import the sampler (torch),
which would delay the engine's spawn by seconds.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

from morion.text.tokenizer import Tokenizer

PLANTED_PROMPT = "<planted front-end fault>"
_FAILING_SEED = int(os.environ["MORION_FAULTY_SEED"])
_encode = Tokenizer.encode


def _failing_encode(self, text, add_special_tokens=True):
    if text == PLANTED_PROMPT:
        raise RuntimeError(f"planted fault: tokenizing {PLANTED_PROMPT}")
    return _encode(self, text, add_special_tokens)


def _plant_sampling_fault() -> None:
    import morion.engine.sampler as sampler

    sampling_probs = sampler.sampling_probs

    def failing_sampling_probs(scores, params):
        if any(p.seed == _FAILING_SEED for p in params):
            raise RuntimeError(f"planted fault: sampling fails for a request seeded {_FAILING_SEED}")
        return sampling_probs(scores, params)

    sampler.sampling_probs = failing_sampling_probs


Tokenizer.encode = _failing_encode
if multiprocessing.current_process().name == "morion-engine":  # engine_spawn.py names it
    _plant_sampling_fault()

if __name__ == "__main__":
    from morion.cli import main

    sys.exit(main())
