"""A real `morion serve` subprocess on the default model, on a free loopback port.

One server (`server`) is shared by every test module here; tests that stop a server start their own with
`start_server`. Every wait is bounded, and only 127.0.0.1 is ever contacted.

The shared server runs through `faulty_morion.py`, which plants two faults that only a request made for
them meets (a sampling failure for requests seeded FAILING_SEED, a front-end error for one prompt), and
has short read and grammar bounds and one allowed browser origin, for the hardening tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from tests.ports import free_port

API_KEY = "test-key"
STARTUP_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60
# The shared server's profile; the command line sets max-model-len again, and must win.
FAILING_SEED = 424242  # faulty_morion.py makes the engine's sampling fail for requests with this seed
ALLOWED_ORIGIN = "https://app.example"
READ_TIMEOUT_S = 1.5
GRAMMAR_MEMORY_GB = 0.25
MAX_REQUEST_BYTES = 2 * 2**20
PROFILE = f"""
kv-cache-tokens = 8192
max-model-len = 1024
chunk-size = 512
max-request-bytes = {MAX_REQUEST_BYTES}
served-model-name = "smollm2"
read-timeout = {READ_TIMEOUT_S}
allowed-origins = "{ALLOWED_ORIGIN}"
grammar-timeout = 5
grammar-memory-gb = {GRAMMAR_MEMORY_GB}
log-requests = true
"""
MAX_MODEL_LEN = 2048  # from the command line, over the profile's 1024


@dataclass
class RunningServer:
    process: subprocess.Popen
    base_url: str
    log_path: Path
    api_key: str | None
    health_seen: list[int] = field(default_factory=list)  # /health statuses while starting

    def http(self, authenticated: bool = True, timeout: float = 60) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if authenticated and self.api_key else {}
        # trust_env=False: never route loopback traffic through a proxy from the environment.
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, trust_env=False)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            http_client=httpx.Client(timeout=60, trust_env=False),
        )

    def async_openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            http_client=httpx.AsyncClient(timeout=60, trust_env=False),
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_once_it_has(self, text: str, timeout: float = 30) -> str:
        """The log, once `text` is in it (or the timeout passed). Lines written after a response has
        been sent, like the request log's, can reach the file after the client has its answer."""
        deadline = time.monotonic() + timeout
        while text not in (log := self.log()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return log

    def server_info(self) -> dict:
        with self.http() as client:
            response = client.get("/v1/server_info")
            response.raise_for_status()
            return response.json()

    def child_pids(self) -> list[int]:
        """Processes whose parent is the server (the engine, multiprocessing's resource tracker)."""
        children = []
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                fields = dict(
                    line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line
                )
            except OSError:
                continue
            if fields.get("PPid", "").strip() == str(self.process.pid):
                children.append(int(status.parent.name))
        return children


def launch(
    args: Sequence[str],
    log_path: Path,
    api_key: str | None = None,
    entry: Sequence[str] = ("-m", "morion"),
    env: dict[str, str] | None = None,
) -> RunningServer:
    """Starts `morion serve` without waiting for it. `entry`: how Python runs morion (a script in its
    place, say); `env`: added to the environment."""
    port = free_port()
    command = [sys.executable, *entry, "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    if api_key:
        command += ["--api-key", api_key]
    # One torch thread: the engine shares a small machine with its front end, the test process and maybe
    # other jobs, and torch's multi-threaded CPU kernels slow down by orders of magnitude when their
    # threads are descheduled. These tests check behaviour, not speed.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    log = log_path.open("w")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
    )
    return RunningServer(process, f"http://127.0.0.1:{port}", log_path, api_key)


def wait_until_ready(server: RunningServer, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=server.base_url, timeout=5, trust_env=False) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(f"morion serve exited with {server.process.returncode}:\n{server.log()}")
            try:
                status = client.get("/health").status_code
            except httpx.TransportError:
                status = None
            if status is not None:
                server.health_seen.append(status)
                if status == 200:
                    return
            time.sleep(0.2)
    stop(server)
    raise RuntimeError(f"morion serve was not ready after {timeout} s:\n{server.log()}")


def start_server(
    args: Sequence[str], log_path: Path, api_key: str | None = None, **launch_options
) -> RunningServer:
    server = launch(args, log_path, api_key, **launch_options)
    wait_until_ready(server)
    return server


def stop(server: RunningServer, timeout: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM, then SIGKILL if it does not exit in time; returns the exit status."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(10)
    return server.process.returncode


class ServerControl:
    """For tests that need a server of their own (to stop it, or to watch it start)."""

    launch = staticmethod(launch)
    wait_until_ready = staticmethod(wait_until_ready)
    start = staticmethod(start_server)
    stop = staticmethod(stop)


@pytest.fixture(scope="session")
def server_control(smollm2_gguf: Path) -> type[ServerControl]:
    return ServerControl


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Iterator[RunningServer]:
    directory = tmp_path_factory.mktemp("server")
    profile = directory / "serve.toml"
    profile.write_text(PROFILE)
    running = start_server(
        ["--config", str(profile), "--max-model-len", str(MAX_MODEL_LEN), "--device", "cpu"],
        directory / "serve.log",
        api_key=API_KEY,
        entry=(str(Path(__file__).with_name("faulty_morion.py")),),
        env={"MORION_FAULTY_SEED": str(FAILING_SEED)},
    )
    yield running
    status = stop(running)
    assert status == 0, running.log()
