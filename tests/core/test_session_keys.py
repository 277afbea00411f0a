"""Session affinity (core/sessions.py): the table, the routing hint with its margin, the
gossip field, and on the twin: a session goes where it was served last, learnt by gossip."""

from __future__ import annotations

import random
from dataclasses import replace

import msgpack
import pytest

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.cache_summary import pack_hashes
from radixmesh.core.codec import Codec, RemoteProtocolError
from radixmesh.core.config import NodeConfig
from radixmesh.core.cost_model import Candidate
from radixmesh.core.events import ExecuteLocally, Forward, RequestArrived
from radixmesh.core.messages import Gossip, Load
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.core.sessions import SessionConfig, SessionTable
from radixmesh.testing import TwinCluster

S = 0xC0FFEE


def test_the_table_remembers_the_last_node_within_ttl_and_capacity() -> None:
    t = SessionTable("me", SessionConfig(ttl_s=10.0, capacity=2, max_gossip=2))
    t.note(S, "a", 0.0)
    t.learn("b", [S], 1.0)  # newest wins
    assert t.where(S, 5.0) == "b" and t.where(S, 11.5) is None  # expired
    t.served(1, 0.0)
    t.served(2, 1.0)
    t.served(3, 2.0)
    assert len(t) == 2 and t.where(1, 2.0) is None  # least recently seen dropped
    assert t.recent(3.0) == (3, 2) and t.recent(11.5) == (3,)


def _c(node: str, latency: float, is_self: bool = False) -> Candidate:
    return Candidate(node, is_self, 0, latency)


def test_the_hint_yields_to_a_prediction_slower_by_more_than_the_margin() -> None:
    t = SessionTable("me", SessionConfig(margin_s=0.5))
    ranked = [_c("me", 1.0, True), _c("a", 1.4), _c("b", 2.0)]
    up = lambda _: True  # noqa: E731
    t.note(S, "a", 0.0)
    assert [c.node_id for c in t.prefer(ranked, S, 0.0, True, up)] == ["a", "me", "b"]
    t.note(S, "b", 0.0)
    assert t.prefer(ranked, S, 0.0, True, up) == ranked  # 1.0 s slower > 0.5 s margin
    assert [c.node_id for c in t.prefer(ranked, S, 0.0, False, up)] == ["b", "me", "a"]
    t.note(S, "c", 0.0)  # not ranked: first only without predictions, and only if available
    assert t.prefer(ranked, S, 0.0, True, up) == ranked
    assert t.prefer(ranked, S, 0.0, False, lambda _: False) == ranked
    assert t.prefer(ranked, S, 0.0, False, up)[0].node_id == "c"
    assert (t.hints_followed, t.hints_overruled) == (3, 3)


def test_gossip_carries_at_most_256_sessions() -> None:
    codec = Codec()
    msg = Gossip("n1", "mem://n1", 1, 1, 1, 7, 0.0, Load(0, 0, 0, 0, None), sessions=(3, 9, S))
    assert codec.decode(codec.encode(msg)).sessions == (3, 9, S)
    data = bytearray(codec.encode(replace(msg, sessions=())))
    too_many = pack_hashes(range(257))
    fields = msgpack.unpackb(bytes(data))
    fields[18] = too_many
    with pytest.raises(RemoteProtocolError, match="sessions"):
        codec.decode(msgpack.packb(fields, use_bin_type=True))


@pytest.mark.parametrize("policy", [Policy.PAPER, Policy.COST])
def test_on_the_twin_a_session_follows_where_it_was_served(policy: Policy) -> None:
    c = TwinCluster(4, router=RouterConfig(policy=policy), seed=3)
    c.run_for(2.0)
    rng = random.Random(5)
    chain = tuple(rng.getrandbits(64) for _ in range(64))  # a long history, on n1 and n2
    for node in ("n1", "n2"):
        c.change_cache(node, list(chain))
    [here] = c.deliver("n2", RequestArrived(1, chain, 1024, 0, 4, local_only=True, session=S))
    assert isinstance(here, ExecuteLocally)
    c.run_for(2.0)  # n2's gossip tells n0 that n2 served S
    assert c.nodes["n0"]._parts.sessions.where(S, c.now) == "n2"
    for rid in range(2, 12):  # each turn: the session's node, never the other copy
        [there] = c.deliver("n0", RequestArrived(rid, chain, 1024, 0, 4, session=S))
        assert isinstance(there, Forward) and there.peer_id == "n2", there
    [other] = c.deliver("n0", RequestArrived(20, (), 64, 0, 4, session=S + 1))
    assert isinstance(other, ExecuteLocally)  # an unknown session: routed as any request


def test_a_node_config_carries_the_margin() -> None:
    cfg = NodeConfig("n0", "mem://n0", Fingerprint("m", "t"), 1)
    assert cfg.sessions.margin_s == 0.5
    with pytest.raises(ValueError, match="margin_s"):
        SessionConfig(margin_s=-1.0)
