"""The server's front end starts without torch: it reads the tokenizer, never the weights, so its imports
do not race the engine process's for the CPU while the model loads (docs/server.md, "Start-up"). Grammars
import it later, on first use, through xgrammar (off the event loop)."""

from __future__ import annotations

import subprocess
import sys

FRONT_END = """
import sys
from pathlib import Path
from morion.loader.tokenizer_loader import load_tokenizer
from morion.server import app, describe, engine_client, http_guards, launch, metrics, serving  # noqa: F401
tokenizer = load_tokenizer(Path(sys.argv[1]))
assert tokenizer is not None and tokenizer.encode("Hello")
print(sorted(name for name in sys.modules if name == "torch" or name.startswith("torch.")))
"""


def test_the_front_end_starts_and_reads_its_tokenizer_without_torch(smollm2_gguf):
    result = subprocess.run(
        [sys.executable, "-c", FRONT_END, str(smollm2_gguf)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
