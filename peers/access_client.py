"""A peer's side of invite-only runs: exchange ``--token INVITE`` at the coordinator for an access token.

Used by ``collab join`` and ``collab monitor``. In an open run nothing happens (``None``).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from collab.config import RunConfig
from peers.http_client import HttpError, request_json

if TYPE_CHECKING:
    from collab.swarm.access import Access


class AccessError(RuntimeError):
    """A problem to report in one line (the caller exits non-zero)."""


def _request(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    try:
        out = request_json(url, body, what="the coordinator")
    except HttpError as e:
        raise AccessError(f"the coordinator refused the invite: {e}" if e.status == 403 else str(e)) from None
    if not isinstance(out, dict):
        raise AccessError(f"{url} did not answer with a JSON object")
    return out


def obtain_access(args: argparse.Namespace, cfg: RunConfig, name: str) -> Access | None:
    """Credentials for an invite-only run (``None`` for an open one); raises :class:`AccessError`."""
    if cfg.access == "open":
        return None
    coordinator, invite = getattr(args, "coordinator", None), getattr(args, "token", None)
    if not coordinator or not invite:
        raise AccessError(
            "this run is invite-only: pass --coordinator URL and --token INVITE (from the run's organizer)"
        )
    from collab.swarm.access import (
        Access,
        AccessDenied,
        Credentials,
        check_token,
        local_key,
        public_key_from_text,
        public_key_text,
        token_from_text,
    )

    base = coordinator.rstrip("/")
    info = _request(base + "/v1/run").get("access")
    if not isinstance(info, dict) or not isinstance(info.get("authority_public_key"), str):
        raise AccessError("the coordinator did not publish its authority key")
    try:
        authority = public_key_from_text(info["authority_public_key"])
    except AccessDenied as e:
        raise AccessError(f"the coordinator's authority key is invalid: {e}") from None
    key = local_key()
    body = {"invite": invite, "public_key": public_key_text(key.get_public_key()), "name": name}

    def fetch() -> Any:
        answer = _request(base + "/v1/join", body)
        return token_from_text(str(answer.get("token", "")))

    try:
        token = fetch()
        check_token(token, authority)
    except AccessDenied as e:
        raise AccessError(f"the coordinator's token is not valid: {e}") from None
    credentials = Credentials(authority=authority, token=token, key=key, fetch=fetch)
    if not credentials.matches_key():
        raise AccessError("the coordinator issued a token for another key")
    return Access(credentials)
