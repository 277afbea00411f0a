"""Peer authentication and client API keys in the node's HTTP surface (in-process, fast).

A real ``NodeService`` on the ``micro`` engine behind FastAPI's TestClient: peer endpoints
refuse unauthenticated, forged and replayed messages with 401/403 and count them; a node
without a key warns loudly; ``--api-key`` guards the client API but not ``/health``; the
debug knobs only accept loopback clients. (The keyed multi-process case is test_chaos.py.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from functools import cache

import pytest
from fastapi.testclient import TestClient

from radixmesh.core.auth import ClusterKey, sign
from radixmesh.core.forward_codec import ReplyDecoder, encode_forward_request
from radixmesh.core.messages import ForwardRequest, ForwardResult
from radixmesh.engine.factory import build_engine
from radixmesh.runtime.app import create_app
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.debug import DelayedEngine
from radixmesh.runtime.node import NodeService
from radixmesh.runtime.peer_auth import (
    ApiKeyCheck,
    PeerAuth,
    forward_purpose,
    resolve_secret,
)

KEY = "a-test-cluster-key-of-enough-bytes"
HEADER = "x-radixmesh-auth"  # the wire name, as a peer sends it


@cache
def engine() -> object:
    return build_engine("micro", cache_tokens=2048)


def client_for(monkeypatch: pytest.MonkeyPatch, **config: object) -> TestClient:
    monkeypatch.delenv("RADIXMESH_CLUSTER_KEY", raising=False)
    monkeypatch.delenv("RADIXMESH_API_KEY", raising=False)
    service = NodeService(ServeConfig(port=18_999, **config),  # type: ignore[arg-type]
                          DelayedEngine(engine()))
    return TestClient(create_app(service), client=("127.0.0.1", 50_000))


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    with client_for(monkeypatch, cluster_key=KEY) as c:
        yield c


def metric(client: TestClient, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_peer_endpoints_refuse_and_count(keyed: TestClient) -> None:
    key = ClusterKey.from_text(KEY)
    body = b"\x93\x01\x01\xc0"
    good = sign(key, "gossip", "peer", body, time.time(), b"\x07" * 16)
    assert keyed.post("/peer/gossip", content=body).status_code == 401
    r = keyed.post("/peer/gossip", content=body, headers={HEADER: good.replace("mac=", "mac=0")})
    assert r.status_code == 401 and r.json()["error"]["code"] == "peer_auth_malformed"
    assert keyed.post("/peer/gossip", content=body + b"x", headers={HEADER: good}).status_code \
        == 403
    assert keyed.post("/peer/gossip", content=body, headers={HEADER: good}).status_code == 204
    replay = keyed.post("/peer/gossip", content=body, headers={HEADER: good})
    assert replay.status_code == 403 and replay.json()["error"]["code"] == "peer_auth_replayed"
    fwd = encode_forward_request(ForwardRequest((1, 2), 2))
    assert keyed.post("/peer/forward", content=fwd).status_code == 401
    signed = sign(key, forward_purpose("/peer/forward"), "p", fwd, time.time(), b"\x08" * 16)
    r = keyed.post("/peer/forward", content=fwd, headers={HEADER: signed})
    assert r.status_code == 200
    assert isinstance(ReplyDecoder().feed(r.content)[-1], ForwardResult)
    huge = keyed.post("/peer/gossip", content=b"\x00" * (8 * 1024 * 1024 + 1))
    assert huge.status_code == 413  # refused before any HMAC work
    assert metric(keyed, "radixmesh_peer_auth_rejected_total") == 5
    assert metric(keyed, "radixmesh_peer_auth_rejected_replayed_total") == 1
    assert metric(keyed, "radixmesh_peer_auth_accepted_total") == 2


def test_no_key_warns_loudly_and_accepts(monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), client_for(monkeypatch) as c:
        assert c.post("/peer/gossip", content=b"\x93\x01\x01\xc0").status_code == 204
        assert metric(c, "radixmesh_peer_auth_enabled") == 0
        assert metric(c, "radixmesh_peer_auth_unauthenticated_accepted_total") == 1
    assert any("NO CLUSTER KEY" in r.getMessage() for r in caplog.records)


def test_api_key_guards_client_api(monkeypatch: pytest.MonkeyPatch) -> None:
    with client_for(monkeypatch, api_key="s3cret-token") as c:
        body = {"model": "micro", "prompt": "hello", "max_tokens": 2}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.post("/v1/completions", json=body,
                      headers={"authorization": "Bearer wrong"}).status_code == 401
        ok = c.post("/v1/completions", json=body,
                    headers={"authorization": "Bearer s3cret-token"})
        assert ok.status_code == 200, ok.text
        assert c.get("/mesh").status_code == 401
        assert c.get("/metrics").status_code == 401
        assert c.get("/health").status_code == 200
        assert c.post("/admin/netem", json={"loss": 1}).status_code == 401
        assert c.post("/admin/netem", json={"loss": 0},
                      headers={"authorization": "Bearer s3cret-token"}).status_code == 200


def test_debug_knobs(keyed: TestClient) -> None:
    r = keyed.post("/admin/netem", json={"loss": 0.5, "duplicate": 0.25, "jitter": 0.01})
    assert r.status_code == 200 and r.json()["netem"]["duplicate"] == 0.25
    assert keyed.post("/admin/netem", json={"loss": 2}).status_code == 400
    r = keyed.post("/admin/engine-delay", json={"seconds": 0.05})
    assert r.status_code == 200 and r.json()["engine_delay_s"] == 0.05
    assert keyed.post("/admin/engine-delay", json=[1]).status_code == 400
    reset = keyed.post("/admin/engine-delay", json={"seconds": 0})
    assert reset.status_code == 200 and reset.json()["engine_delay_s"] == 0


def test_debug_knobs_refuse_remote_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    service = NodeService(ServeConfig(port=18_998), DelayedEngine(engine()))
    with TestClient(create_app(service), client=("10.1.2.3", 5000)) as c:
        assert c.post("/admin/netem", json={"loss": 1}).status_code == 403
        assert c.post("/admin/engine-delay", json={"seconds": 1}).status_code == 403


def test_openapi_document_is_served(keyed: TestClient) -> None:
    doc = keyed.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(doc["paths"])


def test_key_rotation_accepts_the_previous_key() -> None:
    old, new = "the-old-cluster-key-0123456789", "the-new-cluster-key-0123456789"
    sender_old = PeerAuth(old, "a", previous_key_text="")
    sender_new = PeerAuth(new, "a", previous_key_text="")
    receiver = PeerAuth(new, "b", previous_key_text=old)
    for sender in (sender_old, sender_new):
        assert sender.key is not None
        body = sender.key.kid.encode()
        verified = receiver.verify(sender.headers("gossip", body), "gossip", body)
        assert verified is not None and (verified.kid, verified.node) == (sender.key.kid, "a")
    assert sender_old.key is not None and sender_new.key is not None
    assert sender_old.key.kid != sender_new.key.kid  # two keys really were in play
    from radixmesh.core.auth import UnknownKey

    with pytest.raises(UnknownKey):  # once the old key is dropped, it is refused
        body = b"x"
        PeerAuth(new, "c", previous_key_text="").verify(sender_old.headers("gossip", body),
                                                       "gossip", body)


def test_small_pieces() -> None:
    assert resolve_secret("flag", {"V": "env"}, "V") == "flag"
    assert resolve_secret("", {"V": "env"}, "V") == "env"
    assert resolve_secret("", {}, "V") == ""
    open_auth = PeerAuth("", "n1")
    assert open_auth.headers("gossip", b"x") == {} and not open_auth.enabled
    assert ApiKeyCheck("").allows(None)
    check = ApiKeyCheck("k")
    assert check.allows("Bearer k") and check.allows("bearer k")
    assert not check.allows("Basic k") and not check.allows(None) and check.rejected == 2
    with pytest.raises(ValueError):
        ServeConfig(cluster_key="short")
    assert "a-test" not in repr(ServeConfig(cluster_key=KEY))
