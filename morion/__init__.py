"""morion: a serving runtime for large hybrid-attention mixture-of-experts language models."""

__version__ = "0.1.0"
