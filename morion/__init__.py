"""morion: a serving runtime for large hybrid-attention mixture-of-experts language models."""

__version__ = "0.1.0"

from morion.engine.sampling_params import SamplingParams
from morion.llm import LLM

__all__ = ["LLM", "SamplingParams", "__version__"]
