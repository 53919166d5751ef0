"""A second signal ends a draining server at once, its engine process with it (issue 21, item 3): the
front end used to wait for the engine, which ignores SIGTERM, and hung for good. The server serves a tiny
preset (random weights, token-id prompts): it starts in seconds, and what is tested does not depend on
the model."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

LONG = {"prompt": [5, 17, 42, 9], "max_tokens": 1500, "ignore_eos": True, "stream": True}


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_a_second_signal_ends_the_server_and_its_engine_at_once(server_control, tmp_path):
    running = server_control.start(
        ["--model", "preset:qwen3-next-tiny", "--device", "cpu", "--shutdown-timeout", "120"],
        tmp_path / "serve.log",
    )
    try:
        children = running.child_pids()
        streaming = [threading.Event() for _ in range(2)]

        def stream(started: threading.Event) -> None:
            try:
                with running.http() as http, http.stream("POST", "/v1/completions", json=LONG) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            started.set()
            except httpx.HTTPError:
                pass  # cut off by the forced exit, as it should be

        readers = [threading.Thread(target=stream, args=(event,), daemon=True) for event in streaming]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 60
        while not all(event.is_set() for event in streaming) and time.monotonic() < deadline:
            time.sleep(0.05)
        running.process.send_signal(signal.SIGTERM)
        assert "draining 2 request(s)" in running.log_once_it_has("draining 2 request(s)")

        running.process.send_signal(signal.SIGINT)  # the second one, as a second Ctrl-C
        started = time.monotonic()
        try:
            status = running.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still runs 20 s after a second signal:\n{running.log()}")
        assert time.monotonic() - started < 5
        assert status == -signal.SIGINT  # ended by the signal, as its default action does
        assert "SIGINT again: stopping at once, 2 request(s) cut off" in running.log()
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in children), "a child process outlived the server"
        for reader in readers:
            reader.join(timeout=10)
    finally:
        server_control.stop(running)
