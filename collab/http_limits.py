"""Limits at the HTTP edge, shared by the config server and the monitor's dashboard.

Both face the Internet, so a request is refused before any route sees it when it is too big or too slow,
and a bug in a route becomes a one-line JSON error, never a traceback page:

* a URL (path + query) longer than ``max_url_bytes``: 414;
* a body over ``max_body_bytes``: 413, from ``Content-Length`` before a byte of it is read, or while
  counting a chunked/streamed body (every body is read here, bounded, before the route runs, so routes
  that never read their body are covered too);
* a malformed ``Content-Length``: 400; a body that does not arrive within ``body_timeout_s``: 408;
* an exception in a route: 500 with ``{"detail": "internal error"}`` (logged here, with its traceback);
* a request that fails validation: 422 naming the fields, without echoing the input back.

Refusals carry ``Connection: close``, so a client cannot keep streaming a refused body into the server.
:func:`install` adds the middleware to a FastAPI app (it covers every route, present and future);
:func:`uvicorn_limits` are the matching uvicorn settings: header size, idle and header-read timeouts,
concurrency. Knows ASGI, FastAPI and uvicorn; nothing of collab.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
MAX_URL_BYTES = 4096
BODY_TIMEOUT_S = 10.0
HEADER_TIMEOUT_S = 10.0  # a connection that has not sent a whole request head by then is closed
MAX_HEADER_BYTES = 16 * 1024  # request line + headers (h11's buffer for an incomplete event)
MAX_CONNECTIONS = 256  # beyond this uvicorn answers 503 instead of queueing more work

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Refuse(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


class _Gone(Exception):
    """The client disconnected before its request was complete."""


class HttpLimits:
    """ASGI middleware: ``app.add_middleware(HttpLimits, max_body_bytes=...)`` (or :func:`install`)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_url_bytes: int = MAX_URL_BYTES,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.max_body_bytes, self.max_url_bytes = max_body_bytes, max_url_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_head(scope)
            body = await self._read_body(receive)
        except _Refuse as e:
            await _send_error(send, e.status, e.detail)
            return
        except _Gone:
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect is left to wait for

        try:
            await self.app(scope, replay, send_tracked)
        except Exception:
            logger.exception("%s %s failed", scope.get("method"), _short(scope.get("path", "")))
            if not started:
                await _send_error(send, 500, "internal error")
            # else: the response is half sent; returning lets the server close the connection

    def _check_head(self, scope: Scope) -> None:
        url_bytes = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        if url_bytes > self.max_url_bytes:
            raise _Refuse(414, f"URL too long: at most {self.max_url_bytes} bytes")
        lengths = [v for k, v in scope.get("headers", []) if k.lower() == b"content-length"]
        for value in lengths:
            if not value.strip().isdigit() or len(value) > 20:
                raise _Refuse(400, "malformed Content-Length")
            if int(value) > self.max_body_bytes:
                raise _Refuse(413, f"request body too large: at most {self.max_body_bytes} bytes")

    async def _read_body(self, receive: Receive) -> bytes:
        """The whole body (at most ``max_body_bytes``) within ``body_timeout_s``."""
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise _Refuse(408, f"request body not received within {self.body_timeout_s:g} s") from None
            if message["type"] == "http.disconnect":
                raise _Gone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _Refuse(413, f"request body too large: at most {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _send_error(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def install(app: Any, **limits: Any) -> None:
    """Add :class:`HttpLimits` to a FastAPI ``app`` (before it serves its first request), and answer
    invalid requests with 422 without echoing their input."""
    from fastapi.exceptions import RequestValidationError

    app.add_middleware(HttpLimits, **limits)
    app.add_exception_handler(RequestValidationError, _validation_error)


async def _validation_error(request: Any, exc: Any) -> Any:
    """FastAPI's own 422 handler echoes each bad input back, and fails with a UnicodeDecodeError (a 500)
    on a body that is not UTF-8; this one names the field and the problem only."""
    from fastapi.responses import JSONResponse

    detail = [
        {
            "loc": [str(p) for p in e.get("loc", ())],
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in exc.errors()
    ]
    return JSONResponse(status_code=422, content={"detail": detail})


def uvicorn_limits(header_timeout_s: float = HEADER_TIMEOUT_S) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments matching these limits (h11 with a header-read timeout)."""
    return {
        "http": _h11_with_header_timeout(header_timeout_s),
        "ws": "none",  # neither app speaks WebSocket: refuse upgrades instead of handing them on
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        "limit_concurrency": MAX_CONNECTIONS,
        "timeout_keep_alive": 5,
        "timeout_graceful_shutdown": 5,
        "server_header": False,
    }


def _h11_with_header_timeout(timeout_s: float) -> Any:
    """uvicorn's h11 protocol, closing a connection whose request head does not arrive in ``timeout_s``.

    uvicorn itself times out only idle keep-alive connections, and any byte resets that timer: a client
    sending its headers one byte at a time (slowloris) would hold a connection for ever. The timer here
    starts when the connection opens and again after each response, and closes the connection if no new
    request has begun by then (a request that is still being answered is never cut).
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class H11WithHeaderTimeout(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            cycle = self.cycle
            self.loop.call_later(timeout_s, self._header_timeout, cycle)

        def _header_timeout(self, cycle: Any) -> None:
            waiting = self.cycle is cycle and (cycle is None or cycle.response_complete)
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return H11WithHeaderTimeout
