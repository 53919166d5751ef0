"""What every suite shares: the endpoint, the served model, the server's identity, progress lines, and the
optional routes (`/metrics`, `/health`) read the same way by each suite."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import httpx

from morion.bench.endpoint import Endpoint
from morion.errors import MorionError
from morion.validate.chat import ChatClient
from morion.validate.options import ValidateOptions


class Session:
    def __init__(self, options: ValidateOptions, stream: TextIO | None = None) -> None:
        self.options = options
        self.stream = stream or sys.stderr
        self._started = time.perf_counter()
        self.endpoint = Endpoint(options.url, options.api_key, options.request_timeout_s, tool="validate")
        self.models = self.endpoint.list_models()
        if options.model is None and not self.models:
            raise MorionError(f"{options.url}/v1/models lists no model: name one with --model")
        self.model = options.model or self.models[0]
        self.server_info = self.endpoint.server_info()
        self.chat = ChatClient(self.endpoint, self.model)

    def say(self, line: str) -> None:
        elapsed = time.perf_counter() - self._started
        self.stream.write(f"validate [{elapsed:7.1f}s] {line}\n")
        self.stream.flush()

    def identity(self) -> dict[str, Any]:
        """The server as results record it: /v1/server_info when it has one, else its model list."""
        return {
            "url": self.options.url,
            "served_model": self.model,
            "models_listed": self.models,
            "server_info": self.server_info,
        }

    def server_config(self) -> dict[str, Any]:
        return (self.server_info or {}).get("config") or {}

    def capacity(self) -> dict[str, Any]:
        return (self.server_info or {}).get("capacity") or {}

    def metrics(self) -> dict[str, float] | None:
        """/metrics as {series: value} (labels kept in the key), or None when the server has none."""
        return self.endpoint.metrics()

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until the server answers again (/health 200, or /v1/models 200 where there is no
        /health); raises MorionError after `timeout_s`."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            try:
                status = self.endpoint.get("/health").status_code
                if status == 404:
                    status = self.endpoint.get("/v1/models").status_code
                if status == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.5)
        raise MorionError(f"{self.options.url} was not healthy {timeout_s:g} s after --restart-cmd")
