"""The coordinator's config server: serves the run config (read-only) and the DHT addresses to join.

Endpoints: ``GET /v1/run`` -> ``{run_id, version, config, initial_peers, dashboard, access}``;
``POST /v1/join`` (invite-only runs) ``{invite, public_key, name}`` -> ``{token, expires}``;
``GET /healthz``.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from collab import __version__, http_limits
from collab.config import RunConfig

if TYPE_CHECKING:  # the access module imports hivemind; the monitor imports this file without it
    from collab.swarm.access import TokenIssuer


class JoinRequest(BaseModel):
    """``POST /v1/join``: the invite, the peer's RSA public key (OpenSSH text) and its display name."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    invite: str = Field(min_length=1, max_length=256)
    public_key: str = Field(min_length=1, max_length=4096)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[\w .@+-]+$")


def build_app(
    cfg: RunConfig,
    initial_peers: Callable[[], list[str]],
    dashboard: str | None = None,
    issuer: TokenIssuer | None = None,
) -> FastAPI:
    """A FastAPI app serving ``cfg``, the current ``initial_peers()`` and the dashboard URL, if any; with
    an ``issuer`` (invite-only runs) also ``POST /v1/join``."""
    app = FastAPI(title="collab coordinator", version=__version__, docs_url=None, redoc_url=None)
    http_limits.install(app)  # size, time and error limits for every route
    payload = cfg.model_dump(mode="json")
    version = cfg.version()
    access: dict[str, Any] = {"mode": cfg.access}
    if issuer is not None:
        access["authority_public_key"] = issuer.public_key

    @app.get("/v1/run")
    def run() -> dict[str, Any]:
        return {
            "run_id": cfg.run_id,
            "version": version,
            "config": payload,
            "initial_peers": initial_peers(),
            "dashboard": dashboard,
            "access": access,
        }

    @app.post("/v1/join")
    def join(request: JoinRequest) -> dict[str, Any]:
        if issuer is None:
            raise HTTPException(404, "this run is open: no token needed")
        from collab.swarm.access import AccessDenied, expiration_of, token_to_text

        try:
            token = issuer.exchange(invite=request.invite, public_key=request.public_key, name=request.name)
        except AccessDenied as e:
            raise HTTPException(403 if "invite" in str(e) else 422, str(e)) from None
        return {"token": token_to_text(token), "expires": expiration_of(token)}

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok", "run_id": cfg.run_id, "version": version}

    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free port), handed to uvicorn so the real port is known."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _quiet_server(app: FastAPI, *, loop: str) -> Any:
    """A uvicorn server that leaves signal handling to us (uvicorn's own re-raises the signal on exit)."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return _Server(
        uvicorn.Config(app, loop=loop, log_level="warning", access_log=False, **http_limits.uvicorn_limits())
    )


def serve_in_thread(app: FastAPI, sock: socket.socket) -> tuple[Any, threading.Thread]:
    """Serve ``app`` from a background thread (e.g. the dashboard next to the config server).

    Returns the uvicorn server (set ``should_exit = True`` to stop it) and its thread.
    """
    server = _quiet_server(app, loop="asyncio")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="collab-http", daemon=True)
    thread.start()
    return server, thread


def serve(app: FastAPI, sock: socket.socket) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn on uvloop), then return so the caller can clean up.

    uvicorn's own signal capture re-raises the signal after shutting down, which would kill the process
    before the caller's ``finally`` stops the DHT (and its p2pd); we install our own handlers instead.
    """
    server = _quiet_server(app, loop="uvloop")

    def stop(signum: int, frame: Any) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
