"""The monitor's HTTP side: the dashboard page and the JSON API it (and scripts) use.

``GET /`` dashboard; ``GET /api/summary``, ``/api/history?since=T``, ``/api/peers``, ``/api/contributors``,
``/api/config``. Static assets ship in the package (no CDN).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse

from monitor.service import Monitor
from peers import http_limits

STATIC = Path(__file__).resolve().parent / "static"


def build_app(monitor: Monitor) -> FastAPI:
    app = FastAPI(title="collab monitor", docs_url=None, redoc_url=None)
    http_limits.install(app)  # size, time and error limits for every route
    cfg = monitor.cfg

    @app.get("/", response_class=HTMLResponse)
    def dashboard() -> str:
        return (STATIC / "index.html").read_text(encoding="utf-8")

    @app.get("/api/summary")
    def summary() -> dict[str, Any]:
        s = monitor.latest
        body: dict[str, Any] = s.as_dict() if s is not None else {"global_step": 0, "alive_peers": 0}
        body.update(
            run_id=cfg.run_id,
            config_version=cfg.version(),
            rejected_records=monitor.store.rejected_count(),
            banned_peers=monitor.store.banned_peers(time.time()),
        )
        return body

    @app.get("/api/history")
    def history(
        since: float = Query(0.0, ge=0), limit: int = Query(5000, ge=1, le=100_000)
    ) -> list[dict[str, Any]]:
        return monitor.store.history(since=since, limit=limit)

    @app.get("/api/peers")
    def peers() -> list[dict[str, Any]]:
        return monitor.peer_table()

    @app.get("/api/bans")
    def bans(limit: int = Query(200, ge=1, le=10_000)) -> list[dict[str, Any]]:
        return monitor.store.bans(limit)

    @app.get("/api/contributors")
    def contributors() -> list[dict[str, Any]]:
        return monitor.store.contributors()

    @app.get("/api/config")
    def config() -> dict[str, Any]:
        m = cfg.method
        return {
            "run_id": cfg.run_id,
            "version": cfg.version(),
            "task": cfg.task.name,
            "method": m.name,
            "device_compressor": m.device_compressor.model_dump(),
            "server_compressor": m.server_compressor.model_dump(),
            "gamma": m.gamma,
            "max_steps": cfg.max_steps,
        }

    return app
