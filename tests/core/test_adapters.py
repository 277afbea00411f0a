"""LoRA adapters (core/adapters.py): names and digests, the gossip field, and on the twin the
hard constraint: a request for an adapter never goes to a peer that does not advertise it."""

from __future__ import annotations

import random
from dataclasses import replace

import msgpack
import pytest

from radixmesh.core.adapters import (
    Adapter,
    AmbiguousAdapter,
    PeerAdapters,
    UnknownAdapter,
    by_name,
    files_digest,
)
from radixmesh.core.codec import Codec, RemoteProtocolError
from radixmesh.core.events import (
    ExecuteLocally,
    Forward,
    ForwardRefused,
    RejectRequest,
    RequestArrived,
)
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


DIGEST_C = files_digest([("adapter_model.safetensors", b"weights C")])


def _mesh_of_holders() -> tuple[TwinCluster, Adapter, Adapter, Adapter]:
    """n0 serves no adapter; n1 and n2 serve different weights as sql-lora; n3 chat-lora."""
    a, b = Adapter("sql-lora", DIGEST_A), Adapter("sql-lora", DIGEST_B)
    chat = Adapter("chat-lora", DIGEST_C)
    c = TwinCluster(4, router=RouterConfig(policy=Policy.PAPER), seed=5)
    for node, served in (("n1", (a,)), ("n2", (b,)), ("n3", (chat,))):
        c.nodes[node] = NodeCore(replace(c.nodes[node].config, adapters=served),
                                 random.Random(node), c.now)
    c.run_for(2.0)
    return c, a, b, chat


def test_a_node_resolves_an_adapter_it_lacks_from_its_peers_adverts() -> None:
    c, a, b, chat = _mesh_of_holders()
    n0 = c.nodes["n0"]
    assert n0.adapter_names() == {"sql-lora", "chat-lora"}
    assert n0.adapter("chat-lora", {}) == chat
    with pytest.raises(AmbiguousAdapter, match=DIGEST_B):  # two weights under one name
        n0.adapter("sql-lora", {})
    assert n0.adapter("sql-lora", {}, pin=DIGEST_B[:16]) == b
    assert n0.adapter("sql-lora", {"sql-lora": a}) == a  # its own adapter wins
    with pytest.raises(UnknownAdapter, match="nope"):
        n0.adapter("nope", {})
    with pytest.raises(UnknownAdapter, match="chat-lora"):
        n0.adapter("chat-lora", {}, pin=DIGEST_A)  # no chat-lora of those weights
    c.crash("n3")
    c.run_for(30.0)  # n3 is declared dead and forgotten: its adapter with it
    assert "chat-lora" not in n0.adapter_names()


def test_a_node_without_the_adapter_forwards_to_a_holder_or_refuses() -> None:
    c, _, _, chat = _mesh_of_holders()
    rng = random.Random(3)
    chain = tuple(rng.getrandbits(64) for _ in range(16))
    c.change_cache("n1", list(chain))  # the prefix is cached where the adapter is not
    c.run_for(1.0)
    for rid in range(1, 5):
        [action] = c.deliver("n0", RequestArrived(rid, chain, 256, 0, 4, adapter=chat.key))
        assert isinstance(action, Forward) and action.peer_id == "n3", action
        [after] = c.deliver("n0", ForwardRefused(rid, "n3", 0.0))
        assert isinstance(after, RejectRequest), after  # never run here, never at n1


def test_gossip_carries_adapter_names_and_refuses_bad_ones() -> None:
    codec = Codec()
    msg = Gossip("n1", "mem://n1", 1, 1, 1, 7, 0.0, Load(0, 0, 0, 0, None), adapters=(5,),
                 adapter_names=(Adapter("sql-lora", DIGEST_A),))
    assert codec.decode(codec.encode(msg)) == msg
    for bad in ([["sql-lora"]], [[3, DIGEST_A]], [["a b", DIGEST_A]], "x"):
        with pytest.raises(RemoteProtocolError, match="adapter_names"):
            codec.decode(msgpack.packb([*msgpack.unpackb(codec.encode(msg))[:20], bad]))


def test_a_profile_prices_loading_a_cold_adapter() -> None:
    from radixmesh.core.profile import Profile, dumps, resolve

    base = resolve("h100-llama3-8b")
    p = replace(base, adapters=("a",), lora_slots=2, lora_load_s=0.5,
                citations={**base.citations, "lora_load_s": "LoRAX issue #433"})
    assert Profile.loads(dumps(p)) == p
    for bad in ("lora_slots = -1", "lora_slots = 1.5", 'lora_load_s = "x"'):
        with pytest.raises(ValueError, match="lora"):
            Profile.loads(bad + "\n" + dumps(base))
