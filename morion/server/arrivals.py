"""Generation requests read by the front end and not yet handed to the engine: how the engine tells a burst.

Clients that send several requests at once (an agent's parallel tool calls, an evaluation harness, a
benchmark's concurrency) have them arrive within a millisecond or two, but the front end hands them over
one by one, each after its own parsing and template. An idle engine woke on the first and prefilled it
alone, and the others waited for that whole forward before theirs: through `morion serve` a burst of four
1K-token prompts took two prefill forwards, one request's and then three's (run 27 on the H200: C4 time to
first token 237 ms, where the offline engine, given all four at once, took 148). So each hand-over says
whether others are on their way (`AddRequest.more_coming`): a request counts from the moment its body has
been read (`ServerContext.read_json`) until it is handed over or its HTTP request ends, and an idle engine
told that more are coming waits for them, briefly (server/engine_process.py `gather_burst`), before its
first step. A request alone is never held up.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

# The endpoints whose requests become engine requests.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
_KEY = "morion.awaiting_handover"  # in the ASGI scope of a request counted in `Arrivals.waiting`


class Arrivals:
    """The count of generation requests whose bodies are read and which are not yet handed over."""

    def __init__(self) -> None:
        self.waiting = 0

    def body_read(self, scope: MutableMapping[str, Any]) -> None:
        """A generation request's body is in: it counts until `handed_over` (once, however often called)."""
        if scope.get("path") in GENERATION_PATHS and not scope.get(_KEY):
            scope[_KEY] = True
            self.waiting += 1

    def handed_over(self, scope: MutableMapping[str, Any]) -> None:
        """The request went to the engine, or its HTTP request ended without (a 400, a client gone)."""
        if scope.pop(_KEY, False):
            self.waiting -= 1


class ArrivalsMiddleware:
    """Ends a request's count when its HTTP request ends, whatever ended it before its hand-over."""

    def __init__(self, app: ASGIApp, arrivals: Arrivals) -> None:
        self.app = app
        self.arrivals = arrivals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            self.arrivals.handed_over(scope)
