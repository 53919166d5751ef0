"""`morion serve` arguments: the TOML profile, and start-ups that must fail with one clear line."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from morion.cli import _build_parser
from morion.errors import MorionError
from morion.server.profile import apply_profile


def _serve_args(tmp_path, profile: str, argv: list[str]):
    path = tmp_path / "profile.toml"
    path.write_text(profile)
    parser = _build_parser()
    argv = ["serve", "--config", str(path), *argv]
    args = parser.parse_args(argv)
    apply_profile(args.profile_parser, args.config)
    return parser.parse_args(argv)


def test_profile_sets_flags_and_the_command_line_wins(tmp_path):
    profile = (
        'port = 9000\nkv_cache_tokens = 4096\nno-prefix-cache = true\nhost = "127.0.0.2"\nkv-cache-gb = 0.5\n'
    )
    args = _serve_args(tmp_path, profile, ["--port", "9001"])
    assert args.port == 9001
    assert args.kv_cache_tokens == 4096
    assert args.enable_prefix_cache is False
    assert args.host == "127.0.0.2"
    assert args.kv_cache_gb == 0.5
    assert _serve_args(tmp_path, "no-prefix-cache = false\n", []).enable_prefix_cache is None  # the default


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        ("bogus = 1\n", "unknown setting 'bogus'"),
        ('port = "eighty"\n', "--port must be a number"),
        ("port = 0\n", "--port must be >= 1"),
        ("no-prefix-cache = 1\n", "must be true or false"),
        ("port = [1]\n", "must be a string or a number"),
        ("port = \n", "not valid TOML"),
    ],
)
def test_bad_profiles_name_the_setting(tmp_path, profile, message):
    with pytest.raises(MorionError, match=message):
        _serve_args(tmp_path, profile, [])


def test_missing_profile(tmp_path):
    with pytest.raises(MorionError, match="cannot read config file"):
        apply_profile(_build_parser(), str(tmp_path / "missing.toml"))


def _serve(*args: str) -> subprocess.CompletedProcess:
    # These fail before anything listens, so no port is ever bound.
    command = [sys.executable, "-m", "morion", "serve", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such/model.gguf"], "model path does not exist"),
        (["--page-size", "3"], "page_size must be a power of two"),
    ],
)
def test_bad_start_up_is_one_line_and_exit_1(args, message):
    result = _serve(*args)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"morion: error: {message}")


def test_a_port_in_use_fails_before_the_model_loads():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        result = _serve("--host", "127.0.0.1", "--port", port)
    assert result.returncode == 1
    assert f"morion: error: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "loading" not in result.stderr


def test_corrupt_gguf_is_rejected_before_listening(tmp_path):
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF" + b"\0" * 64)
    result = _serve("--model", str(corrupt))
    assert result.returncode == 1
    assert "is not a valid GGUF file" in result.stderr.splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.slow
def test_engine_that_cannot_start_ends_the_server(tmp_path, smollm2_gguf):
    # The front end comes up (it reads only the tokenizer); the engine process fails to start, and the
    # server exits with the engine's reason.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    result = _serve("--device", "cuda", "--host", "127.0.0.1", "--port", port)
    assert result.returncode == 1, result.stderr
    assert "morion: error: device 'cuda' requested but CUDA is not available" in result.stderr
