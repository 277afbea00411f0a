"""Per-tenant admission quotas (core/quotas.py) against a simple reference model: a tenant's
counters never exceed its caps, and a tenant's verdict never depends on another's load."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.config import NodeConfig
from radixmesh.core.events import (
    EngineStateChanged,
    Forward,
    ForwardArrived,
    RefuseForward,
    RejectRequest,
    RequestArrived,
)
from radixmesh.core.node import NodeCore
from radixmesh.core.quotas import Bounds, TenantQuotas, admission_bounds, check_share, tenant_caps
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.testing import TwinCluster

TENANTS = ("acme", "umbrella", "initech")
# an operation: a tenant (None: no tenant) arrives with a request of that many tokens, or
# the oldest request of a tenant leaves
ops = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.sampled_from((*TENANTS, None)), st.integers(0, 400)),
    st.tuples(st.just("leave"), st.sampled_from(TENANTS), st.just(0)),
), max_size=60)
bounds = st.builds(Bounds, st.one_of(st.none(), st.integers(1, 12)),
                   st.one_of(st.none(), st.integers(1, 2000)))
shares = st.floats(0.05, 1.0)


def reference_over(held: list[int], tokens: int, share: float, b: Bounds) -> bool:
    """The rule, written out for one tenant's list of held requests (their tokens)."""
    if not held:
        return False
    if b.requests is not None and len(held) + 1 > max(1, math.floor(share * b.requests)):
        return True
    return b.tokens is not None and sum(held) + tokens > max(1, math.floor(share * b.tokens))


@settings(max_examples=200, deadline=None)
@given(ops, shares, bounds)
def test_counters_follow_the_reference_and_never_exceed_the_caps(
    sequence: list[tuple[str, str | None, int]], share: float, b: Bounds
) -> None:
    quotas = TenantQuotas(share)
    model: dict[str, list[tuple[int, int | None]]] = {t: [] for t in TENANTS}
    caps = tenant_caps(share, b)
    for kind, tenant, tokens in sequence:
        if kind == "leave":
            assert tenant is not None
            if model[tenant]:
                _, ticket = model[tenant].pop(0)
                quotas.release(ticket)
                quotas.release(ticket)  # idempotent
            continue
        if tenant is None:  # no tenant: never refused, nothing counted
            assert not quotas.over(None, tokens, b) and quotas.admit(None, tokens) is None
            continue
        expected = reference_over([t for t, _ in model[tenant]], tokens, share, b)
        assert quotas.over(tenant, tokens, b) is expected
        if not expected:
            model[tenant].append((tokens, quotas.admit(tenant, tokens)))
        held = quotas.held(tenant)
        assert held.requests == len(model[tenant])
        assert held.tokens == sum(t for t, _ in model[tenant])
        if caps.requests is not None:
            assert held.requests <= caps.requests
        if caps.tokens is not None and held.requests > 1:  # (one request alone always runs)
            assert held.tokens <= caps.tokens


@settings(max_examples=200, deadline=None)
@given(ops, shares, bounds, st.integers(0, 400))
def test_a_tenant_under_its_share_is_never_refused_for_another_tenants_load(
    sequence: list[tuple[str, str | None, int]], share: float, b: Bounds, tokens: int
) -> None:
    """Acme's verdict is the same whatever the others hold: the same acme operations with
    and without the other tenants' (and untenanted) load in between."""
    alone, crowded = TenantQuotas(share), TenantQuotas(share)
    tickets: dict[tuple[int, str | None], list[int | None]] = {}
    for kind, tenant, size in sequence:
        for quotas in (alone, crowded) if tenant == "acme" else (crowded,):
            mine = tickets.setdefault((id(quotas), tenant), [])
            if kind == "leave" and mine:
                quotas.release(mine.pop(0))
            elif kind == "arrive" and not quotas.over(tenant, size, b):
                mine.append(quotas.admit(tenant, size))
        assert alone.over("acme", tokens, b) is crowded.over("acme", tokens, b)
        assert alone.held("acme") == crowded.held("acme")


def test_quotas_off_never_refuse_and_shares_are_checked() -> None:
    quotas = TenantQuotas(None)
    for _ in range(100):
        quotas.admit("acme", 1000)
    assert not quotas.over("acme", 1000, Bounds(1, 1), requests=50)
    assert quotas.never_fits("acme", 50, Bounds(1, 1)) is None
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="tenant_queue_share"):
            check_share(bad)
    assert check_share(None) is None and check_share(1.0) == 1.0


def test_the_bounds_in_force() -> None:
    assert admission_bounds(None, 30.0, 0.0, None) == Bounds(None, None)  # nothing measured
    assert admission_bounds(None, 30.0, 2.0, 5000) == Bounds(15, 5000)  # 30 s at 2 s each
    assert admission_bounds(8, 30.0, 2.0, None) == Bounds(8, None)  # the tighter count
    assert tenant_caps(0.5, Bounds(5, 999)) == Bounds(2, 499)
    assert tenant_caps(0.01, Bounds(5, 10)) == Bounds(1, 1)  # at least one of each


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 400), max_size=8), st.integers(1, 8), st.integers(0, 2000),
       shares, bounds)
def test_one_api_requests_samples_are_checked_together(
    held: list[int], k: int, tokens: int, share: float, b: Bounds
) -> None:
    """``k`` requests admitted together (one API request's samples and prompts, ``tokens``
    in all): the one-request rule with ``k`` in place of 1 against the request cap; more
    than that cap can never fit (:meth:`never_fits`)."""
    quotas = TenantQuotas(share)
    for t in held:
        quotas.admit("acme", t)
    cap = tenant_caps(share, b).requests
    never = cap is not None and k > cap
    assert quotas.never_fits("acme", k, b) == (cap if never else None)
    assert quotas.never_fits(None, k, b) is None and not quotas.over(None, tokens, b, k)
    one_by_one = reference_over(held, tokens, share, b) or (
        b.requests is not None and len(held) + k > max(1, math.floor(share * b.requests)))
    assert quotas.over("acme", tokens, b, k) is one_by_one


def test_a_refusal_is_counted_only_where_the_quota_decides() -> None:
    """``admission_full_quota``: a request over its tenant's share that a peer takes is no
    refusal; alone, it is rejected as the quota's (the 429 says so), counted once; a forward
    refused for another reason (engine down) is not the quota's."""
    c = TwinCluster(3, router=RouterConfig(policy=Policy.COST), seed=5)
    c.run_for(2.0)
    over = RequestArrived(1, (), 64, 0, 4, over_quota=True)
    [action] = c.deliver("n0", over)
    assert isinstance(action, Forward)
    assert c.nodes["n0"].metrics().get("admission_full_quota", 0) == 0
    solo = NodeCore(NodeConfig("solo", "mem://solo", Fingerprint("m", "bytes", 16), 1),
                    random.Random(0), now=0.0)
    [reject] = solo.handle(over, 0.0)
    assert isinstance(reject, RejectRequest) and reject.quota
    assert solo.metrics()["admission_full_quota"] == 1
    n1 = c.nodes["n1"]
    c.deliver("n1", EngineStateChanged(False, "stopped"))
    forward = ForwardArrived(0, 64, 0, 4, None, over_quota=True)
    assert isinstance(n1.handle(forward, c.now)[0], RefuseForward)
    assert n1.metrics().get("admission_full_quota", 0) == 0
    c.deliver("n1", EngineStateChanged(True, "back"))
    assert isinstance(n1.handle(forward, c.now)[0], RefuseForward)
    assert n1.metrics()["admission_full_quota"] == 1
