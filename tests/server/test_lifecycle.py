"""Start-up, client disconnects and graceful shutdown of a real `morion serve`."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

LONG = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def _wait_until_idle(server, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = server.server_info()
        load = info["load"]
        if load["running"] == 0 and load["waiting"] == 0:
            return info
        time.sleep(0.1)
    raise AssertionError(f"the engine still has work after {timeout} s: {info['load']}")


def _assert_no_leaked_pages(info: dict) -> None:
    load, capacity = info["load"], info["capacity"]
    assert load["pages_held"] == 0
    assert load["pages_free"] + load["pages_cached"] == capacity["num_pages"]
    assert load["integrity"] == "ok"


def _metric(server, series: str) -> float:
    with server.http() as http:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
    return 0.0


def _aborted(server) -> float:
    return _metric(server, 'morion_requests_finished_total{reason="abort"}')


def test_disconnect_mid_stream_aborts_and_frees_pages(server):
    aborted_before = _aborted(server)
    with (
        server.http() as http,
        http.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as response,
    ):
        assert response.status_code == 200
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 3:
                break  # leaving the block closes the connection mid-stream
    info = _wait_until_idle(server, timeout=30)
    _assert_no_leaked_pages(info)
    assert _aborted(server) == aborted_before + 1


def test_disconnect_while_waiting_for_a_whole_response_aborts(server):
    aborted_before = _aborted(server)
    closed = 'morion_http_requests_total{endpoint="/v1/completions",status="499"}'
    closed_before = _metric(server, closed)
    log_before = len(server.log())
    with server.http(timeout=1.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=LONG)
    _assert_no_leaked_pages(_wait_until_idle(server, timeout=30))
    assert _aborted(server) == aborted_before + 1
    # The request ends as a 499 (client closed request), quietly: it used to log InvalidStateError
    # tracebacks, and never reached its 499.
    assert _metric(server, closed) == closed_before + 1
    assert "Traceback" not in server.log()[log_before:]


@pytest.fixture(scope="module")
def own_server(server_control, tmp_path_factory):
    log = tmp_path_factory.mktemp("own-server") / "serve.log"
    args = ["--kv-cache-tokens", "4096", "--device", "cpu", "--log-level", "warning"]
    running = server_control.launch(args, log)
    try:
        server_control.wait_until_ready(running)
        yield running
    finally:
        server_control.stop(running)


def test_health_is_503_while_loading(own_server):
    # The front end listens while the engine process is still loading the model.
    seen = own_server.health_seen
    assert seen[-1] == 200
    assert 503 in seen, seen
    # It says so at once (the engine process is started before the front end's imports), and its load's
    # progress and the startup summary follow; --log-level warning silences uvicorn's INFO lines.
    lines = own_server.log().splitlines()
    engine = int(lines[0].split("(pid ")[1].split(")")[0])
    assert lines[0].startswith("morion serve: loading smollm2-135m-instruct in the engine process")
    assert engine in own_server.child_pids()
    assert any(line.startswith("loading SmolLM2-135M-Instruct.Q4_1.gguf: 272/272") for line in lines)
    assert any(line.startswith("morion serve: ready on http://127.0.0.1:") for line in lines)
    assert not any("Uvicorn running" in line or line.startswith("INFO:") for line in lines)


def test_sigterm_drains_in_flight_requests_then_exits_0(own_server):
    children = own_server.child_pids()
    assert children, "the engine runs in its own process"
    lines: list[str] = []

    def stream() -> None:
        body = LONG | {"max_tokens": 24, "stream": True}
        with own_server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
            lines.extend(line for line in response.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while not any(line.startswith("data: {") for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    own_server.process.send_signal(signal.SIGTERM)
    with own_server.http() as http:
        deadline = time.monotonic() + 10
        while (health := http.get("/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        refused = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "not_ready"
    reader.join(timeout=120)
    assert lines[-1] == "data: [DONE]"
    finish = [
        json.loads(line[6:])["choices"][0]["finish_reason"] for line in lines if line.startswith("data: {")
    ]
    assert finish[-1] == "length"  # finished, not aborted
    assert own_server.process.wait(timeout=60) == 0
    assert "draining 1 request(s)" in own_server.log()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children), "the engine outlived the server"


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status  # a zombie has exited; only its parent's reaping is pending


def test_a_dead_engine_fails_its_requests_and_ends_the_server(server_control, tmp_path):
    running = server_control.start(["--kv-cache-tokens", "2048", "--device", "cpu"], tmp_path / "serve.log")
    try:
        [engine_pid] = [pid for pid in running.child_pids() if "spawn_main" in _command_line(pid)]
        with (
            running.http() as http,
            http.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as response,
        ):
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            os.kill(engine_pid, signal.SIGKILL)
            error = json.loads(next(line for line in lines if line.startswith('data: {"error"'))[6:])
        assert error["error"]["type"] == "internal_server_error"
        assert "engine process exited unexpectedly" in error["error"]["message"]
        assert running.process.wait(timeout=60) == 1
        assert "morion: error: the engine process exited unexpectedly" in running.log()
    finally:
        server_control.stop(running)


def _command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
