"""Cache namespaces: the seed derivation (core/blocks.py), the scheduler's isolation and the
tenant helpers (core/tenants.py)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from radixmesh.core.blocks import (
    NAMESPACE_TOKEN_BASE,
    block_hashes,
    namespace_block,
    namespace_seed,
)
from radixmesh.core.events import Forward, RequestArrived
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.core.scheduler import Finished, Scheduler, SchedulerConfig
from radixmesh.core.tenants import ApiKeys, Namespacer, check_cache_field, parse_api_keys
from radixmesh.testing import TwinCluster

BASE = 0x1234_5678_9ABC_DEF0
tokens_st = st.lists(st.integers(0, NAMESPACE_TOKEN_BASE - 1), min_size=0, max_size=96)
ns_st = st.none() | st.text(max_size=40)


@settings(max_examples=300, deadline=None)
@given(a=tokens_st, b=tokens_st, na=ns_st, nb=ns_st, bs=st.sampled_from([1, 4, 16]))
def test_two_namespaces_never_share_a_block_hash(a: list[int], b: list[int], na: str | None,
                                                 nb: str | None, bs: int) -> None:
    ha = block_hashes(a, bs, namespace_seed(BASE, na, bs))
    hb = block_hashes(b, bs, namespace_seed(BASE, nb, bs))
    if na != nb:
        assert not set(ha) & set(hb)
    else:  # one namespace: hashes name prefixes, as without namespaces
        common = 0
        while common < min(len(ha), len(hb)) and a[: (common + 1) * bs] == b[: (common + 1) * bs]:
            common += 1
        assert ha[:common] == hb[:common]


@given(ns=st.text(max_size=300), bs=st.integers(1, 64))
def test_the_virtual_block_is_out_of_every_vocabulary(ns: str, bs: int) -> None:
    block = namespace_block(ns, bs)
    assert len(block) == bs and all(NAMESPACE_TOKEN_BASE <= t < 2**32 for t in block)
    assert namespace_seed(BASE, ns, bs) == block_hashes(block, bs, BASE)[0]


def test_no_namespace_is_todays_seed() -> None:
    assert namespace_seed(BASE, None, 16) == BASE


def _run(sched: Scheduler) -> list[Finished]:
    done: list[Finished] = []
    for t in range(1000):
        step = sched.schedule(float(t))
        if step.empty:
            break
        done += sched.complete(step, dict.fromkeys(step.emitting, 7), float(t))
    return done


PROMPT = list(range(200))


def test_scheduler_isolates_namespaces_and_reports_without_the_virtual_block() -> None:
    sched = Scheduler(SchedulerConfig(hash_seed=BASE))
    sched.add(1, PROMPT, 2, 0.0, namespace="a")
    (first,) = _run(sched)
    assert (first.prompt_tokens, first.cached_tokens) == (200, 0)
    added, _ = sched.drain_cache_delta()
    want = block_hashes([*PROMPT, 7], 16, namespace_seed(BASE, "a", 16))
    assert set(added) == set(want)  # the mesh's namespaced names, no virtual block
    assert sched.cached_prefix(PROMPT, "a") == 192
    assert sched.cached_prefix(PROMPT, "b") == 0 and sched.cached_prefix(PROMPT) == 0
    for seq, ns in ((2, "b"), (3, None), (4, "a")):
        sched.add(seq, PROMPT, 2, 1.0, namespace=ns)
    hits = {f.seq: f.cached_tokens for f in _run(sched)}
    assert hits == {2: 0, 3: 0, 4: 192}


def test_a_fresh_namespace_block_alone_defers_nobody() -> None:
    """Two prompts sharing only their namespace's (uncomputed) virtual block are admitted
    together: "pioneers first" waits for real shared blocks only; both cache_hashes views
    leave the virtual block out."""
    sched = Scheduler(SchedulerConfig(hash_seed=BASE))
    sched.add(1, PROMPT, 2, 0.0, namespace="a")
    sched.add(2, [p + 1000 for p in PROMPT], 2, 0.0, namespace="a")
    step = sched.schedule(0.0)
    assert {c.seq for c in step.prefills} == {1, 2}
    sched.complete(step, dict.fromkeys(step.emitting, 7), 0.0)
    _run(sched)
    real = set(block_hashes(PROMPT, 16, namespace_seed(BASE, "a", 16)))
    assert real <= sched.cache_hashes() and len(sched.cache_hashes()) == 2 * len(real)


def test_cache_fields_are_short_strings() -> None:
    assert check_cache_field("cache_salt", None) is None
    assert check_cache_field("cache_salt", "") is None
    assert check_cache_field("cache_salt", "x" * 256) == "x" * 256
    for bad in ("x" * 257, 5, ["a"], {"a": 1}, True):
        with pytest.raises(ValueError, match="cache_salt"):
            check_cache_field("cache_salt", bad)


def test_namespace_ids_are_keyed_and_scoped_to_the_tenant() -> None:
    one, other = Namespacer(b"k" * 16), Namespacer(b"j" * 16)
    assert one.namespace_id(None, None) is None
    ids = {one.namespace_id(t, s) for t in (None, "a", "b") for s in (None, "x", "")}
    assert len(ids) == 9 and None in ids  # (None, None) alone is None; all others distinct
    assert one.namespace_id("a", "x") != other.namespace_id("a", "x")
    assert one.namespace_id("a", "x") == Namespacer(b"k" * 16).namespace_id("a", "x")
    assert one.namespace_id("ab", None) != one.namespace_id("a", "b")


def test_api_keys_file_and_callers() -> None:
    keys = parse_api_keys("# tenants\nkey-of-acme-000001 acme\n\nkey-of-umbrella-01 umbrella\n")
    assert keys == {"key-of-acme-000001": "acme", "key-of-umbrella-01": "umbrella"}
    for bad, why in (("short acme", "16"), ("a-long-enough-key1 acme x", "fields"),
                     ("a-long-enough-key1 a/b", "tenant"),
                     ("a-long-enough-key1 a\na-long-enough-key1 b", "twice")):
        with pytest.raises(ValueError, match=why):
            parse_api_keys(bad)
    api = ApiKeys("operator-key-00001", keys)
    assert api.caller("Bearer operator-key-00001") is not None
    op = api.caller("Bearer operator-key-00001")
    assert op is not None and op.operator and op.tenant is None
    acme = api.caller("Bearer key-of-acme-000001")
    assert acme is not None and acme.tenant == "acme" and not acme.operator
    assert api.caller("Bearer nope") is None and api.caller(None) is None
    assert api.rejected == 2
    open_api = ApiKeys()
    assert not open_api.enabled and open_api.caller(None) == op


@pytest.mark.parametrize("policy", [Policy.PAPER, Policy.COST])
def test_on_the_twin_tenant_b_never_routes_by_tenant_a_prefix(policy: Policy) -> None:
    c = TwinCluster(3, router=RouterConfig(policy=policy), seed=11, decision_log=64)
    c.run_for(2.0)
    fp = c.fingerprint
    tokens = list(range(1024))

    def chain(ns: str | None) -> tuple[int, ...]:
        return tuple(block_hashes(tokens, fp.block_size,
                                  namespace_seed(fp.digest, ns, fp.block_size)))

    c.change_cache("n1", list(chain("tenant-a")))
    c.run_for(1.0)
    for rid, ns in enumerate((None, "tenant-b", "tenant-a:other-salt"), 1):
        [action] = c.deliver("n0", RequestArrived(rid, chain(ns), len(tokens), 0, 4))
        assert action.expected_cached == 0, (ns, action)
        assert action.placement in (None, "first", "unplaced", "local_copy"), action
        [kept] = c.nodes["n0"].decisions.recent(request=rid)  # the decision log: nothing held
        assert all(seen.cached_tokens == 0 for seen in kept.considered), kept
    [same] = c.deliver("n0", RequestArrived(9, chain("tenant-a"), len(tokens), 0, 4))
    assert isinstance(same, Forward) and same.peer_id == "n1"
    assert same.expected_cached >= len(tokens) - fp.block_size


def test_a_salted_root_is_indexed_in_its_namespace_and_odd_extra_keys_stay_opaque() -> None:
    from radixmesh.core.engine_index import EngineIndex
    from radixmesh.core.kv_events import EngineBlockStored, salt_of

    assert salt_of([["s"], None], 2) == "s" and salt_of([["s"]], 1) == "s"
    for odd in ([["s", "t"], None], [[7], None], [["s"], ["x"]], [["s"]], "s",
                [["x" * 257], None], [[""], None], None, [None, None]):
        assert salt_of(odd, 2) is None, odd  # not one short salt, or not one entry per block
    tokens = list(range(64))
    index = EngineIndex(16, BASE)
    index.apply_event(EngineBlockStored((11, 12), None, tuple(tokens[:32]), 16, salt="acme"))
    index.apply_event(EngineBlockStored((13, 14), 12, tuple(tokens[32:]), 16))
    index.apply_event(EngineBlockStored((21,), None, tuple(tokens[:16]), 16, keyed=(True,)))
    assert index.match([*tokens, 0], "acme") == 64
    assert index.match([*tokens, 0]) == 0 and index.match([*tokens, 0], "other") == 0
    assert index.hashes() == set(block_hashes(tokens, 16, namespace_seed(BASE, "acme", 16)))


def test_namespace_heads_are_bounded_and_filter_only_virtual_hashes() -> None:
    from radixmesh.core.blocks import NamespaceHeads

    heads = NamespaceHeads(16, BASE, keep=2)
    a = heads.head("a")
    assert heads.head(None) == () and heads.head("a") == a == namespace_block("a", 16)
    h_a = namespace_seed(BASE, "a", 16)
    assert heads.real([1, h_a, 2]) == [1, 2]
    heads.head("b")
    heads.head("c")  # "a" is forgotten (least recently used)
    assert heads.real([h_a]) == [h_a]
    assert heads.real([namespace_seed(BASE, "c", 16)]) == []


def test_a_forward_carries_its_namespace_and_session_and_refuses_bad_ones() -> None:
    import msgpack

    from radixmesh.core.codec import RemoteProtocolError
    from radixmesh.core.forward_codec import decode_forward_request, encode_forward_request
    from radixmesh.core.messages import PROTOCOL_VERSION, ForwardRequest

    req = ForwardRequest((1, 2, 3), 4, namespace="ab" * 16, session=2**64 - 1)
    assert decode_forward_request(encode_forward_request(req)) == req
    plain = ForwardRequest((1, 2, 3), 4)
    assert decode_forward_request(encode_forward_request(plain)) == plain
    fields = msgpack.unpackb(encode_forward_request(req))
    for index, bad in ((11, "x" * 257), (11, ""), (11, 5), (12, -1), (12, 1.5), (12, "1")):
        wrong = list(fields)
        wrong[index] = bad
        with pytest.raises(RemoteProtocolError):
            decode_forward_request(msgpack.packb(wrong))
    older = [PROTOCOL_VERSION - 1, *fields[1:11]]  # a version-2 peer's forward
    with pytest.raises(RemoteProtocolError):
        decode_forward_request(msgpack.packb(older))
