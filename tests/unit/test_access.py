"""Access tokens and signed calls: valid ones pass; missing, foreign, expired, forged, replayed ones fail."""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.proto import dht_pb2
from hivemind.utils.crypto import RSAPrivateKey

from collab.swarm.access import (
    AccessDenied,
    CallSigner,
    CallVerifier,
    Credentials,
    SwarmAuthorizer,
    TokenIssuer,
    check_token,
    issue_token,
    load_or_create_key,
    public_key_text,
    token_from_text,
    token_to_text,
)

AUTHORITY = RSAPrivateKey()
PEER = RSAPrivateKey()
OTHER = RSAPrivateKey()


def _token(key: RSAPrivateKey, ttl_s: float = 60.0, authority: RSAPrivateKey = AUTHORITY):
    return issue_token(authority, name="alice", public_key=key.get_public_key().to_bytes(), ttl_s=ttl_s)


def _creds(key: RSAPrivateKey, token=None, fetch=None) -> Credentials:
    return Credentials(authority=AUTHORITY.get_public_key(), token=token or _token(key), key=key, fetch=fetch)


def test_token_roundtrip_and_checks() -> None:
    token = token_from_text(token_to_text(_token(PEER)))
    check_token(token, AUTHORITY.get_public_key())
    with pytest.raises(AccessDenied, match="expired"):
        check_token(_token(PEER, ttl_s=-1), AUTHORITY.get_public_key())
    with pytest.raises(AccessDenied, match="not signed"):
        check_token(_token(PEER, authority=OTHER), AUTHORITY.get_public_key())
    forged = _token(PEER)
    forged.username = "mallory"  # any change breaks the authority's signature
    with pytest.raises(AccessDenied, match="not signed"):
        check_token(forged, AUTHORITY.get_public_key())
    with pytest.raises(AccessDenied, match="malformed"):
        token_from_text("%%%not base64")


def test_issuer_needs_the_invite_and_a_real_key() -> None:
    issuer = TokenIssuer(AUTHORITY, invite="let-me-in", ttl_s=60)
    token = issuer.exchange(invite="let-me-in", public_key=public_key_text(PEER.get_public_key()), name="a")
    assert token.public_key == PEER.get_public_key().to_bytes()
    with pytest.raises(AccessDenied, match="invalid invite"):
        issuer.exchange(invite="let-me-i", public_key=public_key_text(PEER.get_public_key()), name="a")
    with pytest.raises(AccessDenied, match="not an RSA public key"):
        issuer.exchange(invite="let-me-in", public_key="ssh-rsa AAAAgarbage", name="a")


def test_signed_call_passes_once() -> None:
    signer, verifier = CallSigner(_creds(PEER)), CallVerifier(AUTHORITY.get_public_key(), "callee")
    header = signer.sign("collab.part", "callee", {"step": 3, "w": 0.5}, b"payload")
    assert verifier.verify("collab.part", header, b"payload") == "alice"
    with pytest.raises(AccessDenied, match="replayed"):
        verifier.verify("collab.part", header, b"payload")


@pytest.mark.parametrize(
    "tamper",
    ["payload", "header", "callee", "name"],
)
def test_signed_call_is_bound_to_its_content(tamper: str) -> None:
    signer = CallSigner(_creds(PEER))
    header = signer.sign("collab.part", "callee", {"step": 3}, b"payload")
    name, callee, payload = "collab.part", "callee", b"payload"
    if tamper == "payload":
        payload = b"payloaX"
    elif tamper == "header":
        header = {**header, "step": 4}
    elif tamper == "callee":
        callee = "someone-else"
    else:
        name = "collab.state"
    with pytest.raises(AccessDenied, match="signature"):
        CallVerifier(AUTHORITY.get_public_key(), callee).verify(name, header, payload)


def test_call_without_token_for_another_key_or_expired_is_refused() -> None:
    verifier = CallVerifier(AUTHORITY.get_public_key(), "callee")
    with pytest.raises(AccessDenied, match="no access token"):
        verifier.verify("collab.part", {"step": 1}, b"")
    # A genuine token, but for another key than the one that signs the call.
    foreign = CallSigner(_creds(PEER, token=_token(OTHER)))
    with pytest.raises(AccessDenied, match="signature does not match"):
        verifier.verify("collab.part", foreign.sign("collab.part", "callee", {}, b""), b"")
    expired = CallSigner(_creds(PEER, token=_token(PEER, ttl_s=-5)))
    with pytest.raises(AccessDenied, match="expired"):
        verifier.verify("collab.part", expired.sign("collab.part", "callee", {}, b""), b"")
    stale = CallSigner(_creds(PEER)).sign("collab.part", "callee", {}, b"")
    stale["auth"]["time"] -= 3600
    with pytest.raises(AccessDenied, match="timestamp"):  # checked as the header arrives
        verifier.precheck(stale)
    with pytest.raises(AccessDenied, match="signature"):  # and the time is signed: no fixing it up
        verifier.verify("collab.part", stale, b"")
    stale["auth"]["time"] = float("nan")
    with pytest.raises(AccessDenied, match="timestamp"):
        verifier.precheck(stale)


def test_holder_refreshes_before_expiry() -> None:
    fetched: list[float] = []

    def fetch():
        fetched.append(time.time())
        return _token(PEER, ttl_s=60)

    creds = _creds(PEER, token=_token(PEER, ttl_s=60), fetch=fetch)
    assert creds.current() is creds.token and not fetched  # plenty of lifetime left
    creds.token, creds._issued = _token(PEER, ttl_s=5), time.time() - 55  # 5 s of 60 left: refresh
    old = creds.current()  # still the old token: the refresh runs in the background
    deadline = time.time() + 60
    while creds.token is old and time.time() < deadline:
        time.sleep(0.01)
    # the new token is the one fetched (60 s from when it was issued), however slowly the machine ran
    assert len(fetched) == 1 and float(creds.token.expiration_time) > fetched[0] + 50


def test_a_slow_or_failing_refresh_never_blocks_the_holder() -> None:
    calls: list[float] = []

    def fetch():
        calls.append(time.time())
        time.sleep(0.5)
        raise OSError("coordinator away")

    creds = _creds(PEER, token=_token(PEER, ttl_s=5), fetch=fetch)
    creds._issued = time.time() - 55
    t0 = time.time()
    for _ in range(50):
        assert creds.current() is creds.token
    assert time.time() - t0 < 0.2, "current() must not wait for the coordinator"
    time.sleep(0.8)
    creds.current()
    assert len(calls) == 1, "one refresh at a time, and a failed one waits before retrying"


def _dht_request(authorizer: SwarmAuthorizer) -> dht_pb2.PingRequest:
    request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"x"), validate=False)
    asyncio.run(authorizer.sign_request(request, None))
    return request


def test_dht_requests_need_a_valid_token_for_the_signing_key() -> None:
    server = SwarmAuthorizer(_creds(OTHER, token=_token(OTHER)))
    assert asyncio.run(server.validate_request(_dht_request(SwarmAuthorizer(_creds(PEER)))))
    # token for OTHER's key, request signed by PEER's key
    foreign = SwarmAuthorizer(_creds(PEER, token=_token(OTHER)))
    assert not asyncio.run(server.validate_request(_dht_request(foreign)))
    # a token from another authority
    rogue = SwarmAuthorizer(_creds(PEER, token=_token(PEER, authority=OTHER)))
    rogue.is_token_valid = lambda token: True  # type: ignore[method-assign]  # the rogue trusts itself
    assert not asyncio.run(server.validate_request(_dht_request(rogue)))
    # an expired token (signed by hand: an honest client refuses to send one)
    request = _dht_request(SwarmAuthorizer(_creds(PEER)))
    request.auth.client_access_token.CopyFrom(_token(PEER, ttl_s=-1))
    request.auth.signature = b""
    request.auth.signature = PEER.sign(request.SerializeToString())
    assert not asyncio.run(server.validate_request(request))
    # no token at all
    assert not asyncio.run(server.validate_request(dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"x"))))


def test_authority_key_file_is_created_once(tmp_path) -> None:
    path = tmp_path / "authority.key"
    a = load_or_create_key(str(path))
    b = load_or_create_key(str(path))
    assert a.to_bytes() == b.to_bytes() and (path.stat().st_mode & 0o777) == 0o600
