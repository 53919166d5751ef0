"""Servers for the validate tests: one real `morion serve` on the default model shared by the module that
needs it, and a tiny fake OpenAI server of the tests' own (stdlib `http.server` in a thread) whose
behaviour each test chooses: answers that change on a repeated request or after a restart, a cache salt
honoured, rejected or ignored, no render or tokenize routes, perfect or rejected tool calls. Only
127.0.0.1 is contacted; every wait is bounded."""

from __future__ import annotations

import json
import mmap
import os
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from morion.validate import cases as case_files
from tests.server.conftest import start_server, stop

API_KEY = "validate-key"


@pytest.fixture(scope="module")
def morion_url(smollm2_gguf, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(base URL, API key). A small KV pool (1,024 tokens) with a host tier: the restore flood is short
    and still evicts."""
    directory = tmp_path_factory.mktemp("validate_server")
    args = [
        "--device", "cpu", "--kv-cache-tokens", "1024", "--max-model-len", "1024", "--host-cache-gb", "0.25",
        "--served-model-name", "smollm2", "--api-key", API_KEY,
    ]  # fmt: skip
    running = start_server(args, directory / "serve.log")
    try:
        yield running.base_url, API_KEY
    finally:
        assert stop(running) == 0, running.log()


class FakeBehaviour:
    """What the fake server does; tests set the flags."""

    def __init__(self) -> None:
        self.change_repeats = False  # a repeated identical request gets a different answer
        self.odd_repeat: int | None = None  # only this repeat of a completion prompt (1: the second) does
        # Once this file exists (--restart-cmd touches it) the fake is a "restarted process" that computes
        # every completion otherwise: its answers change, cache hits (what it saw before) or not.
        self.restart_marker: Path | None = None
        # A completion's `cache_salt`: "honour" (a cache of its own: a salted prompt is new), "reject" (400)
        # or "ignore" (as an older server: the prompt hits what it saw unsalted).
        self.salts = "honour"
        # "perfect": the expected calls of tools-v1; "reject": 400 on tools; "never": takes tools, never calls
        self.tools = "perfect"
        self.seen: dict[str, int] = {}
        self.lock = threading.Lock()
        # Memory each completion keeps for good, really allocated (so the process's resident memory grows):
        # `leak_bytes` unexplained, `cache_bytes` reported in /metrics as what its caches hold by design.
        self.leak_bytes = 0
        self.cache_bytes = 0
        self.kept: list[mmap.mmap] = []
        self.cache_held = 0
        self.events: list[str] = []  # "metrics" and "completion", in the order they were served


def _words(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content") or "").split()) for m in messages) + 3 * len(messages)


def _tool_reply(body: dict[str, Any]) -> dict[str, Any]:
    """A perfect tool-calling model for tools-v1: the case's expected calls in order, then its answer."""
    data = case_files.load("tools").data
    messages = body["messages"]
    scripts = [data["probe"], *data["cases"]]
    case = next(c for c in scripts if c["messages"][0]["content"] == messages[0]["content"])
    expected = case.get("expected_calls", [{"name": "get_weather", "arguments": {"city": "Paris"}}])
    done = sum(1 for m in messages if m["role"] == "tool")
    if done < len(expected):
        call = expected[done]
        function = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
        return {"tool_calls": [{"index": 0, "id": f"call_{done}", "type": "function", "function": function}]}
    return {"content": " ".join(case.get("final_contains", ["done"]))}


class _Handler(BaseHTTPRequestHandler):
    behaviour: FakeBehaviour

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _sse(self, chunks: list[dict[str, Any]]) -> None:
        data = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(data.encode())))
        self.end_headers()
        self.wfile.write(data.encode())

    def _metrics(self) -> None:
        """The process's real resident memory, as prometheus_client's process collector exports it."""
        with open("/proc/self/statm") as statm:
            resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        lines = [f"process_resident_memory_bytes {resident}"]
        with self.behaviour.lock:
            self.behaviour.events.append("metrics")
        if self.behaviour.cache_bytes:
            lines.append(f"morion_engine_cache_memory_bytes {self.behaviour.cache_held}")
        data = ("\n".join(lines) + "\n").encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain; version=0.0.4")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _keep_memory(self) -> None:
        behaviour = self.behaviour
        with behaviour.lock:
            behaviour.events.append("completion")
            for size in (behaviour.leak_bytes, behaviour.cache_bytes):
                if size:
                    # A mapping of its own, every page written: resident growth of exactly `size`, never
                    # memory an earlier test freed and the allocator kept.
                    kept = mmap.mmap(-1, size)
                    for offset in range(0, size, mmap.PAGESIZE):
                        kept[offset] = 1
                    behaviour.kept.append(kept)
            behaviour.cache_held += behaviour.cache_bytes

    def do_GET(self) -> None:
        if self.path == "/metrics" and (self.behaviour.leak_bytes or self.behaviour.cache_bytes):
            self._metrics()
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        elif self.path == "/health":
            self._json(200, {"status": "ok"})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/v1/completions":  # the flood, bench's probe, generated restores: one token each
            behaviour = self.behaviour
            salt = body.get("cache_salt")
            if salt is not None and behaviour.salts == "reject":
                self._json(400, {"error": {"message": "cache_salt: unknown field", "param": "cache_salt"}})
                return
            self._keep_memory()
            key = json.dumps(body["prompt"]) + (f" {salt}" if salt and behaviour.salts == "honour" else "")
            with behaviour.lock:
                repeat = behaviour.seen.get(key, 0)
                behaviour.seen[key] = repeat + 1
            usage = {
                "prompt_tokens": len(body["prompt"]),
                "completion_tokens": 1,
                "total_tokens": 0,
                "prompt_tokens_details": {"cached_tokens": len(body["prompt"]) - 1 if repeat else 0},
            }
            restarted = behaviour.restart_marker is not None and behaviour.restart_marker.exists()
            changed = (behaviour.change_repeats and repeat) or repeat == behaviour.odd_repeat or restarted
            logprobs = {"tokens": ["x"], "token_logprobs": [-0.5 if changed else -0.25]}
            self._sse(
                [
                    {"choices": [{"index": 0, "text": "x", "logprobs": logprobs, "finish_reason": "length"}]},
                    {"choices": [], "usage": usage},
                ]
            )
            return
        if self.path != "/v1/chat/completions":
            self._json(404, {"error": {"message": "not found"}})
            return
        behaviour = self.behaviour
        if body.get("tools") and behaviour.tools == "reject":
            self._json(400, {"error": {"message": "tools are not supported", "param": "tools"}})
            return
        key = json.dumps(body["messages"], sort_keys=True)
        with behaviour.lock:
            repeat = behaviour.seen.get(key, 0)
            behaviour.seen[key] = repeat + 1
        prompt = _words(body["messages"])
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": 3,
            "total_tokens": prompt + 3,
            "prompt_tokens_details": {"cached_tokens": prompt - 1 if repeat else 0},
        }
        if body.get("tools") and behaviour.tools == "perfect":
            delta = _tool_reply(body)
        elif body.get("tools"):
            delta = {"content": "I would rather not call anything."}
        else:
            text = body["messages"][-1]["content"]
            codes = re.findall(r"code is ([A-Z0-9-]+)\.", text)
            delta = {"content": "\n".join(codes) if codes else "The answer is 4."}
            if behaviour.change_repeats and repeat:
                delta = {"content": "The answer is 5."}  # the broken cache: a different answer on a hit
        finish = "tool_calls" if "tool_calls" in delta else "stop"
        self._sse(
            [
                {"choices": [{"index": 0, "delta": {"role": "assistant", **delta}, "finish_reason": None}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                {"choices": [], "usage": usage},
            ]
        )


@pytest.fixture
def fake_server() -> Iterator[tuple[str, FakeBehaviour]]:
    """(base URL, behaviour) of a fake OpenAI server without /v1/chat/completions/render or /tokenize."""
    behaviour = FakeBehaviour()
    handler = type("Handler", (_Handler,), {"behaviour": behaviour})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", behaviour
    finally:
        server.shutdown()
        server.server_close()
        for kept in behaviour.kept:
            kept.close()
