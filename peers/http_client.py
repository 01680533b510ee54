"""One careful JSON-over-HTTP request for the command-line tools (join, status, the token exchange).

Everything that can go wrong on the way - a malformed URL, an unreachable host, an HTTP error, a server
that does not speak HTTP, an answer too large, not UTF-8, not JSON, nested too deeply - becomes one
:class:`HttpError` with a one-line message; the tools print it and exit non-zero.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class HttpError(RuntimeError):
    """A request that failed, in one line."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def check_url(url: str, flag: str) -> None:
    """Raise :class:`HttpError` unless ``url`` looks like ``http(s)://HOST[:PORT]``."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number in 0..65535)
    except ValueError as e:
        raise HttpError(f"{flag}: {url!r:.200} is not a valid URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HttpError(f"{flag}: {url!r:.200} is not a URL like http://HOST:PORT")


def request_json(
    url: str,
    body: dict[str, Any] | None = None,
    *,
    timeout_s: float = 15.0,
    max_bytes: int = 1_000_000,
    what: str = "the server",
) -> Any:
    """GET ``url`` (or POST ``body`` as JSON) and return the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        detail = ""
        try:
            answer = json.loads(e.read(10_000))
            if isinstance(answer, dict) and isinstance(answer.get("detail"), str):
                detail = f": {answer['detail'][:200]}"
        except (ValueError, RecursionError, OSError):
            pass
        raise HttpError(f"{url} answered HTTP {e.code}{detail}", status=e.code) from None
    except http.client.InvalidURL as e:  # e.g. a space in the host name
        raise HttpError(f"{url!r:.200} is not a valid URL ({e})") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise HttpError(f"cannot reach {what} at {url}: {getattr(e, 'reason', e)}") from None
    except (http.client.HTTPException, ValueError) as e:  # garbage instead of HTTP, a URL urllib refuses
        raise HttpError(f"{url} did not answer with HTTP ({e.__class__.__name__})") from None
    if len(raw) > max_bytes:
        raise HttpError(f"{url} answered with more than {max_bytes} bytes")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deeply
        raise HttpError(f"{url} did not answer with JSON") from None
