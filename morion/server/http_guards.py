"""What a request must get past before the routes see it: browser checks and a deadline for its headers.

Browsers. A page open in a local browser can send requests to a loopback server. A "simple" request (a
form post: `text/plain`, `application/x-www-form-urlencoded`, `multipart/form-data`, or no Content-Type
at all) needs no CORS preflight, so it would start a generation even though the page cannot read the
answer. Hence: a POST must be `Content-Type: application/json` (415 otherwise), which a page can only send
cross-origin after a preflight; and a request that carries an `Origin` header (browsers add it to
cross-origin requests and to every POST, DNS-rebinding pages included) is refused (403) unless the origin
is listed in `--allowed-origins`, which also turns on CORS answers for those origins. Clients that are not
browsers send no Origin and are not affected.

Slow clients. uvicorn times out idle keep-alive connections but not a request whose headers arrive one
byte at a time (slowloris): `with_header_deadline` closes a connection whose request line and headers
have not all arrived within the read timeout; the body's deadline is `ServerContext.read_json`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from morion.server.errors import error_body


def install_browser_guards(app: FastAPI, allowed_origins: Sequence[str]) -> None:
    """Adds the Origin and Content-Type checks, and CORS for `allowed_origins` ("*": any origin) around
    them, so that CORS answers preflights and its headers reach the browser on every response."""
    app.add_middleware(_BrowserGuard, allowed_origins=frozenset(allowed_origins))
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"],
        )


class _BrowserGuard:
    def __init__(self, app: ASGIApp, allowed_origins: frozenset[str]) -> None:
        self.app = app
        self.allowed_origins = allowed_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is not None and not ({"*", origin} & self.allowed_origins):
            message = (
                f"requests from the browser origin {origin!r} are not allowed; start the server with "
                "--allowed-origins to allow an origin"
            )
            await _refuse(403, message, "origin_not_allowed", scope, receive, send)
            return
        if scope["method"] == "POST":
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                message = (
                    f"the request body must be sent as Content-Type: application/json "
                    f"(got {media_type or 'no Content-Type'})"
                )
                await _refuse(415, message, "unsupported_media_type", scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _refuse(status: int, message: str, code: str, scope: Scope, receive: Receive, send: Send) -> None:
    # Connection: close, as the unread body is not drained.
    response = JSONResponse(error_body(status, message, code=code), status, headers={"connection": "close"})
    await response(scope, receive, send)


def with_header_deadline(protocol: type[asyncio.Protocol], timeout: float) -> type[asyncio.Protocol]:
    """`protocol` (uvicorn's h11 or httptools protocol class) closing any connection that has not sent a
    whole request line and headers within `timeout` seconds: of opening, or of the first byte of a next
    request. Both protocols start a request cycle (`self.cycle`) only once its headers are complete, and
    mark it `response_complete` when it is answered; between requests uvicorn's keep-alive timeout rules.
    """

    class HeaderDeadline(protocol):  # type: ignore[misc, valid-type]
        _deadline: asyncio.TimerHandle | None = None
        _armed_for: object = None  # the request cycle before the request the deadline is for

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self._arm()

        def data_received(self, data: bytes) -> None:
            # A next request's first bytes: its own full period, whatever is left of a deadline armed
            # for an earlier one.
            if self._awaiting_headers() and (self._deadline is None or self._armed_for is not self.cycle):  # type: ignore[attr-defined]
                self._disarm()
                self._arm()
            super().data_received(data)  # type: ignore[misc]

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)  # type: ignore[misc]

        def _awaiting_headers(self) -> bool:
            cycle = self.cycle  # type: ignore[attr-defined]
            return cycle is None or cycle.response_complete

        def _arm(self) -> None:
            self._armed_for = self.cycle  # type: ignore[attr-defined]
            self._deadline = asyncio.get_running_loop().call_later(timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            # Answered or being answered since it was armed: the connection is idle between requests
            # (uvicorn's keep-alive timeout rules it) or busy with one; a next request's first byte arms
            # a deadline of its own. Closing an idle connection here raced clients reusing it.
            if not self._awaiting_headers() or self.cycle is not self._armed_for:  # type: ignore[attr-defined]
                return
            transport = self.transport  # type: ignore[attr-defined]
            if not transport.is_closing():
                transport.close()

    HeaderDeadline.__name__ = HeaderDeadline.__qualname__ = f"HeaderDeadline{protocol.__name__}"
    return HeaderDeadline
