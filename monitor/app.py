"""The monitor's HTTP side: the dashboard page and the JSON API it (and scripts) use.

``GET /`` dashboard; ``GET /api/summary``, ``/api/history?since=T``, ``/api/peers``, ``/api/contributors``,
``/api/config``, ``/api/join`` (the command that joins this run), ``/api/gallery`` (the model keeper's
samples, newest step last) and ``/gallery/NAME.png``. Static assets ship in the package (no CDN).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse, HTMLResponse

from collab import gallery, http_limits
from monitor.service import Monitor

STATIC = Path(__file__).resolve().parent / "static"


def build_app(
    monitor: Monitor, *, gallery_dir: str | Path | None = None, join_command: str | None = None
) -> FastAPI:
    """The dashboard of ``monitor``'s run; ``gallery_dir`` is the model keeper's gallery folder (if it
    runs), ``join_command`` what a viewer runs to join (shown in the "How to join" panel)."""
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
        if not body.get("alive_peers"):  # nobody trains now: show where the run got to, not zeros
            last = monitor.store.last_summary()
            if last is not None:
                body.update(
                    global_step=last["global_step"], metric=last["metric"], metric_name=last["metric_name"]
                )
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
            "metric_name": "rel_distance" if cfg.task.name == "bilinear" else "loss",
            "target": cfg.target_rel_distance if cfg.task.name == "bilinear" else None,
        }

    @app.get("/api/join")
    def join() -> dict[str, Any]:
        return {"command": join_command, "invite_only": cfg.access == "invite"}

    @app.get("/api/gallery")
    def gallery_index() -> dict[str, Any]:
        if gallery_dir is None:
            return {"entries": []}
        index = gallery.read_index(gallery_dir)
        return {"entries": [e.model_dump() for e in index.entries]}

    @app.get("/gallery/{name}")
    def gallery_image(name: str) -> FileResponse:
        # only names the keeper writes, inside its folder: never a path a request makes up
        if gallery_dir is None or not gallery.IMAGE_NAME.match(name):
            raise HTTPException(404, "no such image")
        path = Path(gallery_dir) / name
        if not path.is_file():
            raise HTTPException(404, "no such image")
        return FileResponse(path, media_type="image/png")

    return app
