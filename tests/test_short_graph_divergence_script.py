"""scripts/short_graph_divergence.py's mechanics on the CPU (no graphs there: both tails run eagerly, so every
cache component must come out the same), and its report of a component that differs."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.scripts import load_script


def _script():
    return load_script("short_graph_divergence")


def test_two_eager_tails_leave_every_component_the_same(capsys):
    module = _script()
    module.main(["--preset", "qwen3-next-tiny", "--prompt-tokens", "37", "--tokens", "3", "--device", "cpu"])
    out = capsys.readouterr().out
    compared = [line for line in out.splitlines() if line.startswith(("  same", "  DIFF"))]
    assert compared[:3] == ["  same  page kv", "  same  state conv", "  same  state recurrent"]
    # Every module of the tiny model's two layers was recorded in both tails, and all agree.
    assert len(compared) == 4 and compared[3].startswith("  same  every module: ")
    assert int(compared[3].split(": ")[1].split()[0]) > 10
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


def test_the_first_module_whose_output_parts_from_the_same_input_is_named(capsys):
    module = _script()
    x = torch.ones(2, 4)
    eager = [("layers.0.mlp", x, x * 2), ("layers.1.self_attn", x * 2, x * 3), ("layers.1.mlp", x * 3, x)]
    replayed = [eager[0], ("layers.1.self_attn", x * 2, x * 3 + 0.25), ("layers.1.mlp", x * 3 + 0.25, x)]
    module.compare_calls(replayed, eager)
    out = capsys.readouterr().out
    assert "DIFF  layers.1.self_attn output: 8 of 8 values, largest 2.500e-01" in out
    assert "DIFF  layers.1.mlp input: 8 of 8 values" in out
    assert "2 of 3 calls differ; the paths part at layers.1.self_attn" in out
    assert "layers.0.mlp" not in out


def test_the_scratch_page_and_slot_are_left_out_of_the_comparison():
    module = _script()
    pages = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 12)  # 2 layers, 3 pages of 4 slots
    states = torch.arange(2 * 3 * 5, dtype=torch.float32).view(2, 3, 5)  # 2 layers, 3 slots
    component = SimpleNamespace(name="kv")
    pool = SimpleNamespace(
        spec=SimpleNamespace(token_components=[component]), page_size=4, storage=lambda name: pages
    )
    slots = SimpleNamespace(
        spec=SimpleNamespace(state_components=[SimpleNamespace(name="conv")]), storage=lambda name: states
    )
    runner = SimpleNamespace(pool=pool, state_slots=slots, scratch_pages=[1], scratch_slots=[2])
    found = module.caches(SimpleNamespace(runner=runner))
    assert found["page kv"][:, 4:8].eq(0).all() and torch.equal(found["page kv"][:, :4], pages[:, :4])
    assert torch.equal(found["page kv"][:, 8:], pages[:, 8:])
    assert found["state conv"][:, 2].eq(0).all() and torch.equal(found["state conv"][:, :2], states[:, :2])
    assert pages[:, 4:8].ne(0).all()  # the engine's own memory is left as it was
