"""`import morion` and the commands that run no model stay light: torch (3 s on a 2-core CPU) is imported
only when an engine is built, so `morion validate` against another server, `morion cache` and every
command's argument parsing do not pay for it (the server's front end: test_front_end_imports.py)."""

from __future__ import annotations

import json
import subprocess
import sys

STAGES = """
import json, sys

def torch_loaded():
    return any(name == "torch" or name.startswith("torch.") for name in sys.modules)

seen = {}
import morion
seen["import morion"] = torch_loaded()
import morion.cli
seen["morion.cli"] = torch_loaded()
from morion.validate.run import run_validate
seen["morion validate"] = torch_loaded()
from morion.cache.disk_admin import list_namespaces
seen["morion cache"] = torch_loaded()
morion.LLM  # what builds an engine does import it
seen["morion.LLM"] = torch_loaded()
print(json.dumps(seen))
"""


def test_torch_is_imported_only_by_what_builds_an_engine():
    result = subprocess.run([sys.executable, "-c", STAGES], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "import morion": False,
        "morion.cli": False,
        "morion validate": False,
        "morion cache": False,
        "morion.LLM": True,
    }
