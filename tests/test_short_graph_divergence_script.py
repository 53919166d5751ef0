"""scripts/short_graph_divergence.py's mechanics on the CPU (no graphs there: both tails run eagerly, so every
cache component must come out the same), and its report of a component that differs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).parents[1] / "scripts" / "short_graph_divergence.py"


def _script():
    spec = importlib.util.spec_from_file_location("short_graph_divergence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_eager_tails_leave_every_component_the_same(capsys):
    module = _script()
    module.main(["--preset", "qwen3-next-tiny", "--prompt-tokens", "37", "--tokens", "3", "--device", "cpu"])
    out = capsys.readouterr().out
    compared = [line for line in out.splitlines() if line.startswith(("  same", "  DIFF"))]
    assert compared == ["  same  page kv", "  same  state conv", "  same  state recurrent"]
    answers = [line for line in out.splitlines() if "tail (0 replays): tokens" in line]
    assert len(answers) == 4 and answers[2].split(":")[1] == answers[3].split(":")[1]


def test_a_differing_component_is_named_with_its_layers_and_rows(capsys):
    module = _script()
    replayed = {"state recurrent": torch.zeros(3, 5, 2), "page kv": torch.zeros(2, 4)}
    eager = {name: tensor.clone() for name, tensor in replayed.items()}
    eager["state recurrent"][1, 4, 0] = 0.5
    module.compare(replayed, eager)
    out = capsys.readouterr().out
    assert "DIFF  state recurrent: 1 of 30 values, layers [1], rows [4], largest difference 5.000e-01" in out
    assert "same  page kv" in out
