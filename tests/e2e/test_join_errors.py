"""`collab join` against a wrong coordinator: one clear line on stderr, a non-zero exit, no traceback.

A closed port is in test_roles.py; here: malformed URLs, a server that answers 404 or 500, one that
answers garbage, HTML, invalid UTF-8, JSON that is not a run (or a run whose config is invalid, whose
version does not match, whose peer list is not a list, or that is far too big), and a TCP server that
does not speak HTTP at all. The servers are real (stdlib HTTP and a raw socket on 127.0.0.1).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from collab.config import load_config
from peers.join import fetch_run
from tests.conftest import CONFIGS, run_cli

CFG = load_config(CONFIGS / "demo.yaml")
GOOD_RUN = {"run_id": CFG.run_id, "version": CFG.version(), "config": CFG.model_dump(mode="json")}

# path prefix -> (status, content type, body)
ANSWERS: dict[str, tuple[int, str, bytes]] = {
    "/missing": (404, "text/html", b"<h1>Not Found</h1>"),
    "/broken": (500, "text/plain", b"Internal Server Error"),
    "/garbage": (200, "application/json", b'{"run_id": "x", "config": {'),
    "/html": (200, "text/html", b"<!doctype html><title>router login</title>"),
    "/binary": (200, "application/json", b"\xff\xfe\x00\x01" * 64),
    "/list": (200, "application/json", b"[1, 2, 3]"),
    "/other": (200, "application/json", json.dumps({"hello": "world"}).encode()),
    "/badconfig": (200, "application/json", json.dumps({**GOOD_RUN, "config": {"method": 5}}).encode()),
    "/version": (200, "application/json", json.dumps({**GOOD_RUN, "version": "0" * 16}).encode()),
    "/peers": (200, "application/json", json.dumps({**GOOD_RUN, "initial_peers": 5}).encode()),
    "/deep": (200, "application/json", b"[" * 100_000 + b"]" * 100_000),
    "/huge": (200, "application/json", b'{"pad": "' + b"x" * 2_000_000 + b'"}'),
}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        prefix = "/" + self.path.lstrip("/").split("/", 1)[0]
        status, ctype, body = ANSWERS.get(prefix, (404, "text/plain", b"no"))
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="module")
def not_http_url() -> Iterator[str]:
    """A TCP server that answers every connection with bytes that are not HTTP, then hangs up."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            with conn, contextlib.suppress(OSError):
                conn.settimeout(2)
                conn.recv(4096)
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\x00\x01\x02garbage")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        sock.close()


def _join_fails(url: str, *, needle: str) -> str:
    res = run_cli("join", "--coordinator", url, "--no-progress", timeout=60)
    err = res.stderr.strip()
    assert res.returncode != 0, f"{url}: exit 0\n{res.stderr}"
    assert "Traceback" not in err and err.count("\n") == 0, f"{url}: not one line:\n{res.stderr}"
    assert needle in err, f"{url}: {err!r} does not say {needle!r}"
    assert res.stdout == ""
    return err


@pytest.mark.parametrize(
    "path,needle",
    [
        ("/missing", "answered HTTP 404"),
        ("/broken", "answered HTTP 500"),
        ("/garbage", "did not answer with JSON"),
        ("/html", "did not answer with JSON"),
        ("/binary", "did not answer with JSON"),
        ("/deep", "did not answer with JSON"),
        ("/list", "did not answer with a run description"),
        ("/other", "did not answer with a run description"),
        ("/badconfig", "the coordinator's config is invalid: method: "),
        ("/version", "config version mismatch"),
        ("/peers", "bad initial_peers"),
        ("/huge", "more than 1000000 bytes"),
    ],
)
def test_join_a_server_that_is_not_a_coordinator(http_url: str, path: str, needle: str) -> None:
    _join_fails(http_url + path, needle=needle)


def test_join_a_server_that_does_not_speak_http(not_http_url: str) -> None:
    _join_fails(not_http_url, needle="did not answer with HTTP")


@pytest.mark.parametrize(
    "url,needle",
    [
        ("127.0.0.1:8000", "is not a URL like http://HOST:PORT"),
        ("ftp://127.0.0.1:8000", "is not a URL like http://HOST:PORT"),
        ("http://", "is not a URL like http://HOST:PORT"),
        ("http://[::1", "is not a valid URL"),
        ("http://127.0.0.1:99999", "is not a valid URL"),
        ("http://127.0.0.1:port", "is not a valid URL"),
        ("http://exa mple.com:8000", "is not a valid URL"),
        ("http://no-such-host.invalid:8000", "cannot reach the coordinator"),
    ],
)
def test_join_a_malformed_coordinator_url(url: str, needle: str) -> None:
    _join_fails(url, needle=needle)


def test_the_good_answer_is_accepted_by_the_same_server(http_url: str) -> None:
    """Control: the refusals above come from the answers, not the server (a valid run is fetched)."""
    ANSWERS["/good"] = (
        200,
        "application/json",
        json.dumps({**GOOD_RUN, "initial_peers": ["/ip4/x"]}).encode(),
    )
    try:
        cfg, peers = fetch_run(http_url + "/good", timeout_s=10)
    finally:
        del ANSWERS["/good"]
    assert cfg == CFG and peers == ["/ip4/x"]


def test_resume_needs_a_checkpoint_path() -> None:
    res = run_cli("join", "--config", str(CONFIGS / "demo.yaml"), "--resume", timeout=60)
    assert (
        res.returncode == 2
        and res.stderr.strip() == "--resume: needs --checkpoint PATH (the file to resume from)"
    )
