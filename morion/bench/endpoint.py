"""One OpenAI-compatible server as seen from a client: its HTTP clients, its model list and its identity.

Shared by `morion bench --url` (remote.py) and `morion validate`, so both reach a server the same way:
bearer key, no proxy from the environment, a wait while it loads (503), one clear line when it cannot be
reached or rejects the key.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from typing import Any

import httpx

from morion.errors import MorionError

READY_WAIT_S = 600.0  # a server still loading its model answers 503; a full-size model takes minutes


class Endpoint:
    def __init__(self, url: str, api_key: str | None, timeout_s: float, tool: str = "bench") -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.tool = tool  # names the command in the one line said while waiting

    def client(self, **limits: int) -> httpx.AsyncClient:
        # trust_env=False: a proxy from the environment would be timed along with the server.
        return httpx.AsyncClient(
            base_url=self.url,
            headers=self.headers,
            timeout=httpx.Timeout(self.timeout_s, connect=10.0),
            trust_env=False,
            limits=httpx.Limits(**limits) if limits else httpx.Limits(),
        )

    def get(self, path: str) -> httpx.Response:
        """One GET from synchronous code (raises httpx.HTTPError when the server cannot be reached)."""

        async def get() -> httpx.Response:
            async with self.client() as client:
                return await client.get(path)

        return asyncio.run(get())

    def list_models(self, wait_s: float = READY_WAIT_S) -> list[str]:
        """The served model names; waits (up to `wait_s`) while the server answers 503 (loading)."""
        deadline = time.monotonic() + wait_s
        said_waiting = False
        while True:
            try:
                response = self.get("/v1/models")
            except httpx.HTTPError as error:
                raise MorionError(f"cannot reach {self.url}: {error or type(error).__name__}") from None
            if response.status_code != 503 or time.monotonic() > deadline:
                break
            if not said_waiting:
                print(
                    f"{self.tool}: {self.url} is not ready (503); waiting for it", file=sys.stderr, flush=True
                )
                said_waiting = True
            time.sleep(1.0)
        if response.status_code == 401:
            raise MorionError(f"{self.url} rejected the API key (401): pass --api-key")
        if response.status_code != 200:
            raise MorionError(f"{self.url}/v1/models answered {response.status_code}: {response.text[:200]}")
        try:
            return [entry["id"] for entry in response.json().get("data", [])]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise MorionError(f"{self.url}/v1/models did not answer an OpenAI model list") from None

    def server_info(self) -> dict[str, Any] | None:
        """morion's /v1/server_info (resolved config, capacities), when the server has it."""
        try:
            response = self.get("/v1/server_info")
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def metrics(self) -> dict[str, float] | None:
        """/metrics as {series: value} (labels kept in the key), or None when the server has none."""
        try:
            response = self.get("/metrics")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return parse_prometheus(response.text)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            try:
                samples[match.group(1)] = float(match.group(2))
            except ValueError:
                continue
    return samples
