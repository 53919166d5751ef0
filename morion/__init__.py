"""morion: a serving runtime for large hybrid-attention mixture-of-experts language models."""

from __future__ import annotations

from morion.lazy import lazy_attributes

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]

# Imported on first use: `import morion.cli` (every command) and the server's front end before it starts
# the engine must not pay for torch (3 s on a 2-core CPU).
__getattr__ = lazy_attributes(
    __name__, {"LLM": "morion.llm", "SamplingParams": "morion.engine.sampling_params"}
)
