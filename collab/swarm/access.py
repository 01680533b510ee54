"""Access tokens for invite-only runs: who may use the swarm's DHT and call its peers.

The coordinator holds an RSA **authority key** and an **invite** secret. A volunteer proves it holds the
invite (``POST /v1/join``) and receives an :class:`AccessToken` (hivemind's protobuf: ``username``,
``public_key``, ``expiration_time``, ``signature``) bound to its RSA public key - the same process-wide key
that signs its DHT records - its name and an expiry, signed by the authority.

Where tokens are checked:

* **DHT** requests (store, find, ping) go through :class:`SwarmAuthorizer`, a hivemind
  ``TokenAuthorizerBase``: every request carries the caller's token and is signed with the caller's key
  (with a timestamp and a nonce against replays); peers answer nothing to a request without a valid one.
  So a peer without a token cannot read the run's records (no peer list, no state) or write any.
* **collab calls** (matchmaking, averaging, state download) carry the same token and a signature of the
  call (name, callee, header, payload hash, time, nonce) in the frame header: :class:`CallSigner` signs,
  :class:`CallVerifier` checks before the handler runs (and before the payload is read).

A holder refreshes its token before ``refresh_margin`` of its lifetime is left (``fetch`` is called
again; for volunteers that is another ``POST /v1/join``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives import serialization
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time

from collab.files import atomic_write

Bytes = bytes | bytearray | memoryview

MAX_CLOCK_SKEW_S = 60.0
REFRESH_RETRY_S = 5.0
_TOKEN_DOMAIN = b"collab-access-token-v1|"
logger = logging.getLogger(__name__)
_CALL_DOMAIN = b"collab-call-v1|"


class AccessDenied(RuntimeError):
    """A token or a signed call failed verification; the message says why (one line)."""


# ---- keys ----------------------------------------------------------------------------------------------
def load_or_create_key(path: str) -> RSAPrivateKey:
    """The RSA key in ``path`` (DER), created atomically (mode 0600) if the file does not exist."""
    if os.path.exists(path):
        with open(path, "rb") as f:
            return private_key_from_bytes(f.read())
    key = RSAPrivateKey()
    atomic_write(path, key.to_bytes(), mode=0o600)
    return key


def local_key() -> RSAPrivateKey:
    """This process's RSA key: the one hivemind signs its DHT records and requests with."""
    return RSAPrivateKey.process_wide()


def private_key_from_bytes(der: bytes) -> RSAPrivateKey:
    try:
        loaded = serialization.load_der_private_key(der, password=None)
    except ValueError as e:
        raise AccessDenied(f"not an RSA private key: {e}") from None
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = loaded
    return key


def public_key_text(key: RSAPublicKey) -> str:
    return key.to_bytes().decode()


def public_key_from_text(text: str) -> RSAPublicKey:
    try:
        return RSAPublicKey.from_bytes(text.encode())
    except Exception as e:  # cryptography raises several types for garbage
        raise AccessDenied(f"not an RSA public key ({type(e).__name__})") from None


# ---- tokens --------------------------------------------------------------------------------------------
def _token_payload(token: AccessToken) -> bytes:
    return _TOKEN_DOMAIN + b"|".join(
        [token.username.encode(), token.public_key, token.expiration_time.encode()]
    )


def issue_token(authority: RSAPrivateKey, *, name: str, public_key: bytes, ttl_s: float) -> AccessToken:
    """A token for ``public_key`` (OpenSSH bytes) named ``name``, valid for ``ttl_s`` seconds."""
    token = AccessToken(username=name, public_key=public_key, expiration_time=f"{get_dht_time() + ttl_s:.3f}")
    token.signature = authority.sign(_token_payload(token))
    return token


def token_to_text(token: AccessToken) -> str:
    return base64.b64encode(token.SerializeToString()).decode()


def token_from_text(text: str) -> AccessToken:
    try:
        token = AccessToken()
        token.ParseFromString(base64.b64decode(text.encode(), validate=True))
        return token
    except Exception:  # binascii / protobuf decode errors
        raise AccessDenied("malformed access token") from None


def expiration_of(token: AccessToken) -> float:
    try:
        return float(token.expiration_time)
    except ValueError:
        return 0.0


def check_token(token: AccessToken, authority: RSAPublicKey, *, now: float | None = None) -> None:
    """Raise :class:`AccessDenied` unless ``token`` is signed by ``authority`` and not expired."""
    if not token.signature or not authority.verify(_token_payload(token), token.signature):
        raise AccessDenied("access token not signed by this run's coordinator")
    if expiration_of(token) <= (get_dht_time() if now is None else now):
        raise AccessDenied(f"access token of {token.username!r} expired")


# ---- the holder's side ---------------------------------------------------------------------------------
@dataclass
class Credentials:
    """This peer's key and token, refreshed through ``fetch`` before it expires.

    Args:
        authority: the coordinator's public key (from ``/v1/run``).
        token: the current token (its public key must be ``key``'s).
        key: this peer's RSA key (hivemind's process-wide key: the one that signs its DHT records).
        fetch: returns a fresh token (``None``: this token cannot be refreshed).
        refresh_margin: refresh when less than this share of the token's lifetime is left.
    """

    authority: RSAPublicKey
    token: AccessToken
    key: RSAPrivateKey = field(default_factory=RSAPrivateKey.process_wide)
    fetch: Callable[[], AccessToken] | None = None
    refresh_margin: float = 0.3
    _issued: float = field(default_factory=get_dht_time)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _refreshing: bool = False
    _next_try: float = 0.0
    _pid: int = field(default_factory=os.getpid)

    def matches_key(self) -> bool:
        """Whether the token was issued for this peer's key (peers refuse it otherwise)."""
        return self.token.public_key == self.key.get_public_key().to_bytes()

    def needs_refresh(self, token: AccessToken | None = None) -> bool:
        t = token or self.token
        lifetime = max(1.0, expiration_of(t) - self._issued)
        return expiration_of(t) - get_dht_time() < self.refresh_margin * lifetime

    def current(self) -> AccessToken:
        """The token. Close to expiry, a refresh starts in the background (never blocking the caller,
        which may be an event loop); a failed one is retried after ``REFRESH_RETRY_S``."""
        if self.fetch is not None and self.needs_refresh():
            if self._pid != os.getpid():  # forked (hivemind's DHT process): the parent's thread is not ours
                self._pid, self._lock, self._refreshing = os.getpid(), threading.Lock(), False
            with self._lock:
                start = not self._refreshing and time.monotonic() >= self._next_try
                self._refreshing = self._refreshing or start
            if start:
                threading.Thread(target=self._refresh, name="collab-token-refresh", daemon=True).start()
        return self.token

    def _refresh(self) -> None:
        assert self.fetch is not None
        try:
            fresh = self.fetch()
            check_token(fresh, self.authority)
            self._issued = get_dht_time()
            self.token = fresh
        except Exception as e:  # the coordinator may be briefly away: keep the old token, retry later
            logger.warning("could not refresh the access token (%s); retrying in %.0fs", e, REFRESH_RETRY_S)
            self._next_try = time.monotonic() + REFRESH_RETRY_S
        finally:
            self._refreshing = False

    def __getstate__(self) -> dict[str, Any]:  # picklable for hivemind's DHT process
        state = self.__dict__.copy()
        state["_lock"], state["_refreshing"] = None, False
        state["token"] = self.token.SerializeToString()
        state["authority"] = self.authority.to_bytes()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        token = AccessToken()
        token.ParseFromString(state["token"])
        authority = RSAPublicKey.from_bytes(state["authority"])
        state.update(token=token, authority=authority, _lock=threading.Lock())
        self.__dict__.update(state)


class SwarmAuthorizer(TokenAuthorizerBase):
    """hivemind's token protocol for the DHT, with collab's tokens (see the module docstring)."""

    def __init__(self, credentials: Credentials) -> None:
        super().__init__(credentials.key)
        self.credentials = credentials

    async def get_token(self) -> AccessToken:
        return self.credentials.current()

    def is_token_valid(self, access_token: AccessToken) -> bool:
        try:
            check_token(access_token, self.credentials.authority)
            return True
        except AccessDenied:
            return False

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return self.credentials.needs_refresh(access_token)


# ---- signed calls --------------------------------------------------------------------------------------
def _call_payload(name: str, callee: str, header: dict[str, Any], digest: str, t: float, nonce: str) -> bytes:
    body = json.dumps(header, sort_keys=True, separators=(",", ":"))
    return _CALL_DOMAIN + "|".join([name, callee, digest, repr(t), nonce, body]).encode()


class CallSigner:
    """Adds ``auth`` (token, time, nonce, signature) to an outgoing call's header."""

    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials

    def sign(
        self, name: str, callee: str, header: dict[str, Any], payload: Bytes | Sequence[Bytes]
    ) -> dict[str, Any]:
        token = self.credentials.current()
        t, nonce = get_dht_time(), secrets.token_hex(12)
        h = hashlib.sha256()
        for piece in [payload] if isinstance(payload, bytes | bytearray | memoryview) else payload:
            h.update(piece)
        digest = h.hexdigest()
        sig = self.credentials.key.sign(_call_payload(name, callee, header, digest, t, nonce))
        auth = {"token": token_to_text(token), "time": t, "nonce": nonce, "sig": sig.decode()}
        return {**header, "auth": auth}


class CallVerifier:
    """Checks an incoming call's ``auth``: a valid token, a fresh timestamp, an unused nonce, a signature
    by the token's key over this call. ``precheck`` runs before the payload is read, ``verify`` after."""

    def __init__(self, authority: RSAPublicKey, me: str) -> None:
        self.authority, self.me = authority, me
        self._nonces: dict[str, float] = {}
        self._lock = threading.Lock()

    def precheck(
        self, header: dict[str, Any], *, check_time: bool = True
    ) -> tuple[AccessToken, dict[str, Any]]:
        auth = header.get("auth")
        if not isinstance(auth, dict):
            raise AccessDenied("no access token: this run is invite-only")
        token = token_from_text(str(auth.get("token", "")))
        check_token(token, self.authority)
        t = auth.get("time")
        if not isinstance(t, float | int) or not math.isfinite(t):
            raise AccessDenied("call without a valid timestamp")
        if check_time and abs(float(t) - get_dht_time()) > MAX_CLOCK_SKEW_S:
            raise AccessDenied("call timestamp too far from now (clock skew or a replay)")
        return token, auth

    def verify(self, name: str, header: dict[str, Any], payload: Bytes) -> str:
        """The caller's token name; raises :class:`AccessDenied`."""
        # The timestamp was checked when the header arrived (a long upload must not expire it here).
        token, auth = self.precheck(header, check_time=False)
        nonce = str(auth.get("nonce", ""))
        body = {k: v for k, v in header.items() if k != "auth"}
        digest = hashlib.sha256(payload).hexdigest()
        signed = _call_payload(name, self.me, body, digest, float(auth["time"]), nonce)
        key = RSAPublicKey.from_bytes(token.public_key)
        if not key.verify(signed, str(auth.get("sig", "")).encode()):
            raise AccessDenied("call signature does not match the token's key")
        now = time.monotonic()
        with self._lock:
            if nonce in self._nonces:
                raise AccessDenied("replayed call")
            self._nonces[nonce] = now + 3 * MAX_CLOCK_SKEW_S
            if len(self._nonces) > 10_000:
                self._nonces = {n: exp for n, exp in self._nonces.items() if exp > now}
        return token.username


@dataclass
class Access:
    """Everything a node needs in an invite-only run: credentials to present and the authority to check."""

    credentials: Credentials

    @property
    def authorizer(self) -> SwarmAuthorizer:
        return SwarmAuthorizer(self.credentials)

    def signer(self) -> CallSigner:
        return CallSigner(self.credentials)

    def verifier(self, me: str) -> CallVerifier:
        return CallVerifier(self.credentials.authority, me)


class TokenIssuer:
    """The coordinator's side: exchanges the invite for tokens signed by the authority key.

    Example::

        issuer = TokenIssuer(load_or_create_key("runs/authority.key"), invite="s3cret", ttl_s=3600)
        token = issuer.exchange(invite="s3cret", public_key=peer_key_text, name="alice")
    """

    def __init__(self, authority: RSAPrivateKey, *, invite: str, ttl_s: float) -> None:
        self.authority, self.ttl_s = authority, ttl_s
        self.invite = invite
        self.public_key = public_key_text(authority.get_public_key())

    def exchange(self, *, invite: str, public_key: str, name: str) -> AccessToken:
        """A token for ``public_key``; raises :class:`AccessDenied` for a wrong invite or key."""
        if not secrets.compare_digest(invite.encode(), self.invite.encode()):
            raise AccessDenied("invalid invite")
        key = public_key_from_text(public_key)
        return issue_token(self.authority, name=name, public_key=key.to_bytes(), ttl_s=self.ttl_s)

    def credentials(self, name: str = "coordinator") -> Credentials:
        """Credentials for the coordinator's own node (it issues its own tokens)."""
        key = RSAPrivateKey.process_wide()
        pub = key.get_public_key().to_bytes()

        def fetch() -> AccessToken:
            return issue_token(self.authority, name=name, public_key=pub, ttl_s=self.ttl_s)

        return Credentials(authority=self.authority.get_public_key(), token=fetch(), key=key, fetch=fetch)
