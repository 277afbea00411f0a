"""Per-tenant admission quotas (core/quotas.py) against a simple reference model: a tenant's
counters never exceed its caps, and a tenant's verdict never depends on another's load."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.quotas import Bounds, TenantQuotas, admission_bounds, check_share, tenant_caps

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
            assert not quotas.refuse(None, tokens, b) and quotas.admit(None, tokens) is None
            continue
        expected = reference_over([t for t, _ in model[tenant]], tokens, share, b)
        assert quotas.refuse(tenant, tokens, b) is expected
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
    assert not quotas.refuse("acme", 1000, Bounds(1, 1)) and quotas.refused == 0
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
