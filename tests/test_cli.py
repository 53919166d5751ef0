"""The `morion` command as a user runs it: a real subprocess, real files, the real default model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_morion(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "morion", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_generate_answers_paris(smollm2_gguf):
    result = run_morion(
        "generate",
        "--chat",
        "--prompt",
        "What is the capital of France? Answer in one word.",
        "--max-tokens",
        "16",
        "--temperature",
        "0",
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    # Progress from the start (the first line comes before torch is imported), then the load's own.
    lines = result.stderr.splitlines()
    assert lines[0] == "morion: loading smollm2-135m-instruct"
    assert any(line.startswith("loading SmolLM2-135M-Instruct.Q4_1.gguf: 272/272 tensors") for line in lines)
    assert any(line.startswith("morion: generating after a prompt of ") for line in lines)


def test_pull_prints_the_stored_path(smollm2_gguf):
    result = run_morion("pull")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(smollm2_gguf)


def _assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode != 0
    # The progress line that `generate` writes before its imports is not part of the error.
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("morion: loading ")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_negative_max_tokens():
    _assert_one_line_error(
        run_morion("generate", "--prompt", "x", "--max-tokens", "-5"), "--max-tokens", "-5"
    )


def test_negative_temperature():
    _assert_one_line_error(run_morion("generate", "--prompt", "x", "--temperature", "-1"), "--temperature")


def test_missing_model_path(tmp_path):
    missing = tmp_path / "missing"
    _assert_one_line_error(run_morion("generate", "--prompt", "x", "--model", str(missing)), str(missing))


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _assert_one_line_error(run_morion("generate", "--prompt", "x", "--model", str(tmp_path)), "safetensors")


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bloom"}))
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    _assert_one_line_error(run_morion("generate", "--prompt", "x", "--model", str(tmp_path)), "'bloom'")


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    _assert_one_line_error(run_morion("generate", "--prompt", "x", "--model", str(path)), "not a valid GGUF")


def test_every_command_s_help_renders(capsys):
    """argparse formats help texts with %: a stray "%" in one flag's help broke `--help` of every command
    that takes the engine flags."""
    from morion.cli import _build_parser

    parser = _build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, command in commands.items():
        text = command.format_help()
        assert f"morion {name}" in text, name
    assert "--qsa-prefill" in commands["serve"].format_help()
    assert "+23 % prefill" in commands["serve"].format_help()
