"""LoRA adapters (core/adapters.py): names and digests, the gossip field, and on the twin the
hard constraint: a request for an adapter never goes to a peer that does not advertise it."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from radixmesh.core.adapters import Adapter, PeerAdapters, by_name, files_digest
from radixmesh.core.codec import Codec
from radixmesh.core.events import ExecuteLocally, Forward, RequestArrived
from radixmesh.core.messages import Gossip, Load
from radixmesh.core.node import NodeCore
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.testing import TwinCluster

DIGEST_A = files_digest([("adapter_model.safetensors", b"weights A")])
DIGEST_B = files_digest([("adapter_model.safetensors", b"weights B")])


def test_names_digests_and_keys() -> None:
    a = Adapter("sql-lora", DIGEST_A)
    assert a.key == int(DIGEST_A[:16], 16) and DIGEST_A != DIGEST_B
    assert files_digest([("b", b"2"), ("a", b"1")]) == files_digest([("a", b"1"), ("b", b"2")])
    assert files_digest([("a", b"12")]) != files_digest([("a1", b"2")])
    for name, digest in (("", DIGEST_A), ("a b", DIGEST_A), ("x", "ABC"), ("x", "12")):
        with pytest.raises(ValueError):
            Adapter(name, digest)
    with pytest.raises(ValueError, match="twice"):
        by_name([a, Adapter("sql-lora", DIGEST_B)])
    table = PeerAdapters()
    table.learn("n1", [a.key])
    assert table.serves("n1", a.key) and not table.serves("n2", a.key)
    table.learn("n1", [])
    assert not table.serves("n1", a.key)


def test_gossip_advertises_adapter_keys() -> None:
    codec = Codec()
    msg = Gossip("n1", "mem://n1", 1, 1, 1, 7, 0.0, Load(0, 0, 0, 0, None), adapters=(5, 9))
    assert codec.decode(codec.encode(msg)).adapters == (5, 9)
    assert codec.decode(codec.encode(replace(msg, adapters=()))).adapters == ()


@pytest.mark.parametrize("policy", [Policy.PAPER, Policy.COST])
def test_on_the_twin_an_adapter_request_goes_only_to_peers_that_serve_it(policy: Policy
                                                                         ) -> None:
    a, b = Adapter("sql-lora", DIGEST_A), Adapter("sql-lora", DIGEST_B)  # one name, two weights
    c = TwinCluster(4, router=RouterConfig(policy=policy), seed=4)
    for node, served in (("n0", (a,)), ("n1", (b,)), ("n2", (a,))):
        cfg = replace(c.nodes[node].config, adapters=served)
        c.nodes[node] = NodeCore(cfg, random.Random(node), c.now)
    c.run_for(2.0)
    known = c.nodes["n0"]._parts.routing._adapters
    assert known is not None and known.serves("n2", a.key)
    assert not known.serves("n1", a.key) and not known.serves("n3", a.key)
    rng = random.Random(2)
    chain = tuple(rng.getrandbits(64) for _ in range(64))
    for node in ("n1", "n3"):  # the prefix is cached where the adapter is not (or differs)
        c.change_cache(node, list(chain))
    c.run_for(1.0)
    for rid in range(1, 9):
        [action] = c.deliver("n0", RequestArrived(rid, chain, 1024, 0, 4, adapter=a.key))
        assert isinstance(action, Forward | ExecuteLocally)
        assert not isinstance(action, Forward) or action.peer_id == "n2", action
    [plain] = c.deliver("n0", RequestArrived(20, chain, 1024, 0, 4))
    if policy is Policy.PAPER:  # without an adapter the copies count again
        assert isinstance(plain, Forward) and plain.peer_id in ("n1", "n3")


def test_a_profile_names_the_adapters_the_emulated_engine_serves() -> None:
    from radixmesh.core.profile import Profile, dumps, resolve

    base = resolve("h100-llama3-8b")
    p = replace(base, adapters=("sql-lora", "chat-lora"))
    assert Profile.loads(dumps(p)) == p and base.adapters == ()
    text = dumps(base)
    for bad in ('[[adapters]]\nname = ""', '[[adapters]]\nname = 3',
                '[[adapters]]\nname = "a"\ndigest = "x"', 'adapters = "sql-lora"'):
        with pytest.raises(ValueError, match="adapters"):
            Profile.loads(text + "\n" + bad + "\n")
