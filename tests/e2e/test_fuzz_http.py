"""Fuzzing the HTTP edges: the config server and the monitor's dashboard, over real sockets.

Both real apps run in this process on 127.0.0.1 (port 0) under uvicorn with the limits `collab`
serves them with (collab/http_limits.py); the monitor has a real MonitorStore on a temporary SQLite file
and a record source that holds no records. Then: random well-formed requests (methods, paths, query
strings, headers, bodies: invalid JSON, random bytes, chunked), mutated request heads, and hostile
cases (1 MB bodies, oversized URLs and headers, bad framing, truncated requests, pipelining), while
three slow clients stall in the background (a half-sent head, a head sent one byte at a time, a body
that never comes). Every request gets a 2xx/4xx (or, for a request that is not HTTP, a clean close)
within 5 s, never a 5xx or a traceback; the slow clients are cut off after the header/body timeouts;
afterwards `/healthz` and `/api/summary` still answer 200.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from collab import http_limits
from collab.config import load_config
from collab.gallery import add_entry
from monitor.app import build_app as build_dashboard
from monitor.service import Monitor
from monitor.store import MonitorStore
from peers.config_server import bind, build_app, serve_in_thread
from tests.conftest import CONFIGS

TIMEOUT_S = 5.0
# a 1x1 PNG: the gallery serves whatever the model keeper wrote
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000001e221bc330000000049454e44ae426082"
)
FUZZ = settings(
    max_examples=300,
    deadline=None,  # each request has its own TIMEOUT_S
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)


class NoRecords:
    """A record source with nothing in it: these tests are about the HTTP edge, not the DHT."""

    def get_dict(self, key: str, *, timeout_s: float) -> dict[str, Any]:
        return {}


class _ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


@dataclass
class Servers:
    config_port: int
    monitor_port: int
    errors: _ErrorLog


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    cfg = load_config(CONFIGS / "demo.yaml")
    store = MonitorStore(tmp_path_factory.mktemp("monitor") / "monitor.sqlite")
    gallery_dir = tmp_path_factory.mktemp("gallery")
    add_entry(gallery_dir, 1, [("a red ring top left on black", PNG, 1, 0)])
    monitor = Monitor(cfg, NoRecords(), store, poll_interval_s=0.5).start()
    errors = _ErrorLog()
    watched = [logging.getLogger(name) for name in ("uvicorn.error", "uvicorn", "collab.http_limits")]
    running = []
    try:
        for app in (
            build_app(cfg, lambda: ["/ip4/127.0.0.1/tcp/1/p2p/QmX"]),
            build_dashboard(
                monitor, gallery_dir=gallery_dir, join_command="collab join --coordinator http://127.0.0.1:1"
            ),
        ):
            sock = bind("127.0.0.1", 0)
            server, thread = serve_in_thread(app, sock)
            running.append((server, thread, sock.getsockname()[1]))
        for log in watched:  # after uvicorn configured its loggers (that drops the handlers they had)
            log.addHandler(errors)
        deadline = time.monotonic() + 20
        while not all(s.started for s, _, _ in running) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(s.started for s, _, _ in running), "the servers did not start"
        yield Servers(running[0][2], running[1][2], errors)
    finally:
        for server, _, _ in running:
            server.should_exit = True
        for _, thread, _ in running:
            thread.join(timeout=15)
        monitor.stop()
        store.close()
        for log in watched:
            log.removeHandler(errors)


# ---- a raw HTTP/1.1 client ------------------------------------------------------------------------------
@dataclass
class Reply:
    status: int | None  # None: the server closed (or reset) the connection without an answer
    head: bytes
    body: bytes
    seconds: float


def _complete(buf: bytes, head_only: bool) -> bool:
    head, sep, body = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    if head.startswith(b"HTTP/1.1 100"):
        return _complete(body, head_only)
    if head_only:
        return True
    length = re.search(rb"(?im)^content-length:\s*(\d+)\s*$", head)
    if length:
        return len(body) >= int(length.group(1))
    if re.search(rb"(?im)^transfer-encoding:\s*chunked", head):
        return body.endswith(b"0\r\n\r\n")
    return False  # read to EOF


def exchange(
    port: int, data: bytes, *, timeout_s: float = TIMEOUT_S, head_only: bool = False, then: bytes = b""
) -> Reply:
    """Send ``data`` (then ``then``, if the server has not answered yet), read one response."""
    start = time.monotonic()
    buf = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        try:
            s.sendall(data)
            if then:
                s.settimeout(0.3)
                with contextlib.suppress(TimeoutError):
                    buf = s.recv(65536)  # an early answer (413 before the body) comes first
                s.settimeout(timeout_s)
                if not buf:
                    s.sendall(then)
            while not _complete(buf, head_only):
                if time.monotonic() - start > timeout_s:
                    raise TimeoutError
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass  # refused mid-send: checked by the caller
        except TimeoutError:
            raise AssertionError(f"no answer within {timeout_s}s to {data[:200]!r}") from None
    seconds = time.monotonic() - start
    while buf.startswith(b"HTTP/1.1 100"):
        buf = buf.partition(b"\r\n\r\n")[2]
    head, _, body = buf.partition(b"\r\n\r\n")
    found = re.match(rb"HTTP/1\.[01] (\d{3}) ", head)
    return Reply(int(found.group(1)) if found else None, head, body, seconds)


def request(
    method: str,
    target: str,
    *,
    headers: list[tuple[str, str]] | None = None,
    body: bytes | None = None,
    chunked: bool = False,
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in headers or []]
    payload = b""
    if body is not None and chunked:
        lines.append("Transfer-Encoding: chunked")
        pieces = [body[i : i + 7000] for i in range(0, len(body), 7000)]
        payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    elif body is not None:
        lines.append(f"Content-Length: {len(body)}")
        payload = body
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + payload


def assert_answered(reply: Reply, what: object, *, allow_close: bool = False) -> None:
    if reply.status is None:
        assert allow_close, f"no HTTP answer to {what!r}"
        return
    assert 200 <= reply.status < 500, f"{reply.status} for {what!r}: {reply.body[:300]!r}"
    assert b"Traceback" not in reply.body, f"a traceback in the answer to {what!r}"


# ---- random well-formed requests ------------------------------------------------------------------------
CONFIG_PATHS = ["/v1/run", "/healthz", "/v1/join", "/"]
MONITOR_PATHS = [
    "/", "/api/summary", "/api/history", "/api/peers", "/api/contributors", "/api/config", "/api/join",
    "/api/gallery", "/gallery/step-000001-00.png", "/gallery/index.json", "/gallery/..%2Findex.json",
    "/gallery/%2e%2e%2fmonitor.sqlite", "/gallery/step-000001-00.png%00",
]  # fmt: skip
ODD_PATHS = [
    "/static/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "//", "/v1/run/", "/v1//run", "/%00",
    "/%ff%fe", "/" + quote("é🙂"), "/api/summary%0d%0aX-Injected:%201", "/" + "a" * 3000, "*",
]  # fmt: skip
SEGMENT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
PATHS = st.sampled_from(CONFIG_PATHS + MONITOR_PATHS + ODD_PATHS) | st.lists(SEGMENT, max_size=4).map(
    lambda parts: "/" + "/".join(quote(p, safe="") for p in parts)
)
QUERY_VALUES = st.sampled_from(
    ["", "0", "-1", "1.5", "nan", "inf", "-inf", "1e999", "abc", "9" * 400, "%00", "%ff", "[]", "true"]
) | SEGMENT.map(lambda v: quote(v, safe=""))
QUERIES = st.dictionaries(
    st.sampled_from(["since", "limit", "x", "", "since[]", "a" * 300]), QUERY_VALUES, max_size=3
).map(lambda q: "&".join(f"{k}={v}" for k, v in q.items()))
HEADER_NAMES = st.sampled_from(
    ["Accept", "Accept-Encoding", "Content-Type", "Cookie", "Origin", "Range", "Upgrade", "X-Forwarded-For",
     "Authorization", "If-None-Match", "X-Odd"]
)  # fmt: skip
HEADER_VALUES = st.sampled_from(
    ["application/json", "text/plain", "multipart/form-data; boundary=zz", "*/*", "gzip, br",
     "bytes=0-1,5-2", "websocket", "Bearer x", "x" * 2000, "", "\u00e9", "a\tb"]
) | st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)  # fmt: skip
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
BODIES = (
    st.none()
    | st.binary(max_size=3000)
    | st.sampled_from([b"{", b"[]", b"null", b"\xff\xfe", b'{"invite": 1}', b"[" * 5000, b'"' + b"x" * 60000])
    | JSON_VALUES.map(lambda v: json.dumps(v).encode())
    | st.fixed_dictionaries(
        {"invite": JSON_VALUES, "public_key": JSON_VALUES, "name": st.text(max_size=70)}
    ).map(lambda v: json.dumps(v).encode())
)


@st.composite
def random_requests(draw: st.DrawFn) -> tuple[bool, bytes, str]:
    on_config = draw(st.booleans())
    routes = ["GET " + p for p in CONFIG_PATHS[:2]] + ["POST /v1/join"] if on_config else MONITOR_PATHS
    real_route = st.sampled_from(routes).map(lambda r: r.split(" ") if " " in r else ["GET", r])
    any_route = st.tuples(
        st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO"]), PATHS
    )
    method, path = draw(real_route | any_route)  # half on the apps' own routes, half anywhere
    query = draw(QUERIES)
    target = path + ("?" + query if query else "")
    headers = draw(st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=4))
    body, chunked = draw(BODIES), draw(st.booleans())
    return on_config, request(method, target, headers=headers, body=body, chunked=chunked), method


@FUZZ
@given(random_requests())
def test_random_requests_get_2xx_or_4xx(servers: Servers, slow_clients: Any, case: Any) -> None:
    on_config, raw, method = case
    port = servers.config_port if on_config else servers.monitor_port
    reply = exchange(port, raw, head_only=method == "HEAD")
    assert_answered(reply, raw[:300])
    event(f"status {reply.status}")
    assert reply.seconds < TIMEOUT_S


BASE_HEADS = [
    b"GET /v1/run HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: application/json",
    b"GET /api/history?since=0&limit=10 HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: fuzz/1.0",
    b"GET /healthz HTTP/1.0",
]


@st.composite
def mutated_heads(draw: st.DrawFn) -> bytes:
    """A request head (no body) with random bytes replaced, inserted or deleted; always terminated."""
    head = bytearray(draw(st.sampled_from(BASE_HEADS)))
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(head)))
        op = draw(st.sampled_from(["replace", "insert", "delete"]))
        byte = draw(st.integers(0, 255))
        if op == "insert" or at == len(head):
            head.insert(at, byte)
        elif op == "replace":
            head[at] = byte
        else:
            del head[at]
    return bytes(head) + b"\r\n\r\n"


@FUZZ
@given(mutated_heads(), st.booleans())
def test_mutated_request_heads_never_get_5xx(
    servers: Servers, slow_clients: Any, raw: bytes, on_config: bool
) -> None:
    port = servers.config_port if on_config else servers.monitor_port
    reply = exchange(port, raw)
    assert_answered(reply, raw, allow_close=True)
    event(f"status {reply.status}")


# ---- hostile cases ---------------------------------------------------------------------------------------
MB = b"x" * 1_000_000
LIMIT = http_limits.MAX_BODY_BYTES


def _json_body(n: int) -> bytes:
    return b'{"invite": "' + b"a" * (n - 14) + b'"}'


ANY_4XX = set(range(400, 500))
HOSTILE: dict[str, tuple[bytes, bytes, set[int | None]]] = {
    # name: (request, sent after a pause unless the server answered first, acceptable statuses)
    "1MB body, announced": (
        b"POST /v1/join HTTP/1.1\r\nHost: a\r\nContent-Length: 1000000\r\n\r\n",
        MB,
        {413},
    ),
    "1MB body at once": (request("POST", "/v1/join", body=MB), b"", {413, None}),
    "1MB chunked body": (request("POST", "/v1/join", body=MB, chunked=True), b"", {413, None}),
    "1MB body on a GET route": (request("GET", "/healthz", body=MB), b"", {413, None}),
    "body at the limit": (request("POST", "/v1/join", body=_json_body(LIMIT)), b"", {422}),
    "body over the limit": (request("POST", "/v1/join", body=_json_body(LIMIT + 1)), b"", {413}),
    "chunked over the limit": (
        request("POST", "/v1/join", body=_json_body(LIMIT + 1), chunked=True),
        b"",
        {413},
    ),
    "expect 100-continue, too big": (
        request("POST", "/v1/join", headers=[("Expect", "100-continue"), ("Content-Length", "999999999")]),
        MB,
        {413},
    ),
    "invalid JSON": (request("POST", "/v1/join", body=b'{"invite": '), b"", {422}),
    "body not UTF-8": (request("POST", "/v1/join", body=b"\x80\xff"), b"", {422}),  # was a 500 in FastAPI
    "deep JSON": (request("POST", "/v1/join", body=b"[" * 60_000), b"", {400, 422}),
    "long URL": (request("GET", "/v1/run/" + "a" * 5000), b"", {414}),
    "long query": (request("GET", "/api/history?since=" + "1" * 5000), b"", {414}),
    "huge header": (request("GET", "/healthz", headers=[("X-Big", "b" * 40_000)]), b"", {200, 400, 431}),
    "many headers": (
        request("GET", "/healthz", headers=[(f"X-{i}", "v") for i in range(2000)]),
        b"",
        {200, 400},
    ),
    "bad Content-Length": (b"POST /v1/join HTTP/1.1\r\nHost: a\r\nContent-Length: 12x\r\n\r\n{}", b"", {400}),
    "negative Content-Length": (
        b"POST /v1/join HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n",
        b"",
        {400},
    ),
    "two Content-Lengths": (
        b"POST /v1/join HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"",
        {400},
    ),
    "length and chunked": (
        b"POST /v1/join HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n",
        b"",
        {400, 422},  # h11 reads the chunked framing and ignores Content-Length (RFC 9112 6.3)
    ),
    "bad chunk size": (
        b"POST /v1/join HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        b"",
        {400, None},
    ),
    "no Host": (b"GET /healthz HTTP/1.1\r\n\r\n", b"", {400}),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"", {None, *ANY_4XX}),
    "HTTP/9": (b"GET /healthz HTTP/9.9\r\nHost: a\r\n\r\n", b"", {None, 200, *ANY_4XX}),
    "binary garbage": (bytes(range(256)) * 4, b"", {400, None}),
    "TLS hello": (
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64 + b"\r\n\r\n",
        b"",
        {400, None},
    ),
    "non-ASCII target": (b"GET /\xff\xfe\xc3\xa9 HTTP/1.1\r\nHost: a\r\n\r\n", b"", {400}),
    "websocket upgrade": (
        request("GET", "/healthz", headers=[("Upgrade", "websocket"), ("Connection", "Upgrade")]),
        b"",
        {200, 400, 404},
    ),
    "NaN query": (request("GET", "/api/history?since=nan&limit=1"), b"", {200, 422}),
    "inf query": (request("GET", "/api/history?since=inf"), b"", {200, 422}),
    "huge limit": (request("GET", "/api/history?limit=" + "9" * 100), b"", {422}),
}
# cases about one app's routes (the other answers 404/405); the rest go to both servers
CONFIG_ONLY = {"body at the limit", "invalid JSON", "body not UTF-8", "deep JSON", "length and chunked"}
MONITOR_ONLY = {"NaN query", "inf query", "huge limit"}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_requests(servers: Servers, slow_clients: Any, name: str) -> None:
    raw, then, statuses = HOSTILE[name]
    ports = [servers.config_port] if name not in MONITOR_ONLY else []
    ports += [servers.monitor_port] if name not in CONFIG_ONLY else []
    for port in ports:
        reply = exchange(port, raw, then=then)
        if port == servers.monitor_port and reply.status in (404, 405):
            continue  # the monitor has no /v1/join: refused by its router, which is just as fine
        assert reply.status in statuses, f"{name}: {reply.status} {reply.head[:200]!r} {reply.body[:200]!r}"
        assert_answered(reply, name, allow_close=None in statuses)
        assert reply.seconds < TIMEOUT_S


def test_truncated_requests_and_pipelining(servers: Servers, slow_clients: Any) -> None:
    for port in (servers.config_port, servers.monitor_port):
        # the client sends part of a request and hangs up: nothing to answer, nothing breaks
        for part in (b"GET /hea", b"POST /v1/join HTTP/1.1\r\nHost: a\r\nContent-Length: 50\r\n\r\n{"):
            with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as s:
                s.sendall(part)
        # 30 requests in one write are answered in order, on the same connection
        path = "/healthz" if port == servers.config_port else "/api/summary"
        raw = request("GET", path) * 30
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as s:
            s.sendall(raw)
            buf, deadline = b"", time.monotonic() + TIMEOUT_S
            while buf.count(b"HTTP/1.1 200 OK") < 30 and time.monotonic() < deadline:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        assert buf.count(b"HTTP/1.1 200 OK") == 30


# ---- slow clients ----------------------------------------------------------------------------------------
@dataclass
class SlowClient:
    name: str
    thread: threading.Thread
    outcome: dict[str, Any]


def _slow(port: int, name: str, steps: list[tuple[float, bytes]], out: dict[str, Any]) -> None:
    """Send each piece after its delay; record how (and when) the server ends the exchange."""
    start = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            for delay, piece in steps:
                time.sleep(delay)
                s.sendall(piece)
            data = s.recv(65536)
            out["status"] = int(data[9:12]) if data.startswith(b"HTTP/1.1 ") else None
    except OSError as e:  # the server closed while we were still sending: the cut-off we expect
        out["status"], out["error"] = None, type(e).__name__
    out["seconds"] = time.monotonic() - start


@pytest.fixture(scope="module")
def slow_clients(servers: Servers) -> Iterator[list[SlowClient]]:
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    plans = {
        # a head that stops half way: closed after the header timeout
        "half a head": (servers.config_port, [(0.0, head)]),
        # slowloris: a header byte every 0.5 s keeps it sending, but never finishes: closed all the same
        "byte by byte": (servers.monitor_port, [(0.0, head)] + [(0.5, b"z")] * 60),
        # a body that never comes: 408 after the body timeout
        "stalled body": (
            servers.config_port,
            [(0.0, b"POST /v1/join HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n{")],
        ),
    }
    clients = []
    for name, (port, steps) in plans.items():
        out: dict[str, Any] = {}
        thread = threading.Thread(target=_slow, args=(port, name, steps, out), daemon=True)
        thread.start()
        clients.append(SlowClient(name, thread, out))
    yield clients
    for c in clients:
        c.thread.join(timeout=40)


def test_slow_clients_are_cut_off_and_do_not_block_others(
    servers: Servers, slow_clients: list[SlowClient]
) -> None:
    # others are served while the slow clients hold their connections
    reply = exchange(servers.config_port, request("GET", "/healthz"))
    assert reply.status == 200 and reply.seconds < 3.0  # the slow ones hold on for 10 s
    for c in slow_clients:
        c.thread.join(timeout=http_limits.HEADER_TIMEOUT_S + http_limits.BODY_TIMEOUT_S + 10)
        assert not c.thread.is_alive(), f"{c.name}: the server never ended the exchange"
    outcome = {c.name: c.outcome for c in slow_clients}
    limit = max(http_limits.HEADER_TIMEOUT_S, http_limits.BODY_TIMEOUT_S) + 5
    assert outcome["half a head"]["status"] is None and outcome["half a head"]["seconds"] < limit
    assert outcome["byte by byte"]["status"] is None and outcome["byte by byte"]["seconds"] < limit
    assert outcome["stalled body"]["status"] == 408 and outcome["stalled body"]["seconds"] < limit


def test_still_serving_after_the_barrage(servers: Servers, slow_clients: Any) -> None:
    config = exchange(servers.config_port, request("GET", "/healthz"))
    assert config.status == 200 and json.loads(config.body)["status"] == "ok"
    summary = exchange(servers.monitor_port, request("GET", "/api/summary"))
    assert summary.status == 200 and json.loads(summary.body)["run_id"] == "demo"
    run = exchange(servers.config_port, request("GET", "/v1/run"))
    assert run.status == 200 and json.loads(run.body)["config"]["run_id"] == "demo"
    assert servers.errors.records == [], "the servers logged errors:\n" + "\n".join(servers.errors.records)


def test_gallery_serves_only_the_keepers_images(servers: Servers) -> None:
    index = json.loads(exchange(servers.monitor_port, request("GET", "/api/gallery")).body)
    assert [e["step"] for e in index["entries"]] == [1]
    image = exchange(servers.monitor_port, request("GET", "/gallery/step-000001-00.png"))
    assert image.status == 200 and image.body == PNG and b"image/png" in image.head
    for path in ("/gallery/index.json", "/gallery/..%2Findex.json", "/gallery/step-000002-00.png",
                 "/gallery/..%2F..%2Fetc%2Fpasswd", "/gallery/step-000001-00.png.tmp"):  # fmt: skip
        assert exchange(servers.monitor_port, request("GET", path)).status == 404, path
    join = json.loads(exchange(servers.monitor_port, request("GET", "/api/join")).body)
    assert join == {"command": "collab join --coordinator http://127.0.0.1:1", "invite_only": False}


def test_no_server_error_page_even_for_a_bug() -> None:
    """A route that raises (our bug) answers 500 with one JSON line, not a traceback page."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    http_limits.install(app)

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret detail")

    with TestClient(app, raise_server_exceptions=False) as client:
        res = client.get("/boom")
    assert res.status_code == 500 and res.json() == {"detail": "internal error"}
    assert "secret" not in res.text and "Traceback" not in res.text
