"""The simulator's centralized gateway (sglang-router / SMG ``cache_aware``), alone and in a run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.config import GossipConfig
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.sim import costs
from radixmesh.sim.gateway import CACHE_AWARE, CacheAwareGateway, GatewayConfig
from radixmesh.sim.network import NetworkConfig
from radixmesh.sim.runner import SimSpec, run
from radixmesh.sim.shell import ClusterConfig
from radixmesh.sim.sweep import parse_policies
from radixmesh.sim.tokens import byte_tokenize
from radixmesh.workload.request import Request

UP4 = [True] * 4


def test_a_match_over_the_threshold_goes_to_its_worker_and_a_weaker_one_to_the_emptiest() -> None:
    gw = CacheAwareGateway(4, GatewayConfig())
    assert gw.choose(list(range(100)), UP4, 0.0) == 0  # all trees empty: the first
    assert gw.choose(list(range(1000, 1050)), UP4, 1.0) == 1  # no match: smallest tree
    # 40 of 100 tokens match worker 0's tree (> 30 %): worker 0, although it is loaded
    assert gw.choose(list(range(40)) + list(range(500, 560)), UP4, 2.0) == 0
    # 25 of 100 match worker 0 (< 30 %): the smallest tree (2 and 3 are empty: 2)
    assert gw.choose(list(range(25)) + list(range(600, 675)), UP4, 3.0) == 2
    assert gw.load == [2, 1, 1, 0]
    assert gw.trees[0].total_tokens == 160 and gw.trees[2].total_tokens == 100


def test_an_imbalance_past_both_thresholds_sends_to_the_least_loaded_worker() -> None:
    gw = CacheAwareGateway(3, GatewayConfig(balance_abs=4, balance_rel=1.5))
    prompt = list(range(64))
    for _ in range(5):  # affinity: every copy of the prompt goes to worker 0
        assert gw.choose(prompt, [True] * 3, 0.0) == 0
    assert gw.load == [5, 0, 0]  # 5 - 0 > 4 and 5 > 1.5 x 0: imbalanced
    assert gw.choose(prompt, [True] * 3, 1.0) == 1  # least loaded, whatever its cache
    assert gw.imbalanced_choices == 1 and gw.balanced_choices == 5
    gw.finished(0)
    gw.finished(0)  # loads 3, 1, 0: 3 - 0 <= 4, balanced again: back to the match, which
    assert gw.choose(prompt, [True] * 3, 2.0) == 1  # 0 and 1 now both hold: the less loaded
    assert gw.choose(list(range(2000, 2064)), [True] * 3, 3.0) == 2  # no match: emptiest


def test_a_longest_match_tie_goes_to_the_less_loaded_worker() -> None:
    gw = CacheAwareGateway(2, GatewayConfig())
    gw.choose([1, 2, 3, 4], [True, True], 0.0)  # worker 0
    gw.choose([9, 9, 9, 9, 9], [True, True], 0.0)  # worker 1 (smallest tree)
    gw.choose([1, 2, 3, 4], [False, True], 0.0)  # worker 0 down: 1, which now holds it too
    gw.finished(1)
    gw.finished(1)
    assert gw.load == [1, 0]
    assert gw.choose([1, 2, 3, 4, 5], [True, True], 1.0) == 1  # both match 4: load decides


def test_down_workers_are_never_chosen_and_loads_do_not_go_negative() -> None:
    gw = CacheAwareGateway(3, GatewayConfig())
    assert gw.choose([5, 6, 7], [False, False, False], 0.0) is None
    assert gw.choose([5, 6, 7], [False, False, True], 0.0) == 2
    gw.finished(2)
    gw.finished(2)
    assert gw.load == [0, 0, 0]


def test_a_tree_is_trimmed_to_its_size_least_recently_used_first() -> None:
    gw = CacheAwareGateway(1, GatewayConfig(max_tree_tokens=100))
    gw.choose(list(range(60)), [True], 0.0)
    gw.choose(list(range(1000, 1060)), [True], 1.0)
    tree = gw.trees[0]
    assert tree.total_tokens <= 100
    assert tree.match(list(range(60))) == 0 and tree.match(list(range(1000, 1060))) == 60


@pytest.mark.parametrize(
    "kw",
    [{"cache_threshold": 1.5}, {"balance_abs": -1}, {"balance_rel": 0.5}, {"max_tree_tokens": 0}],
)
def test_bad_gateway_settings_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        GatewayConfig(**kw)  # type: ignore[arg-type]


class Reference:
    """The policy as its documentation states it, over plain lists of the prompts sent."""

    def __init__(self, workers: int, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.sent: list[list[tuple[int, ...]]] = [[] for _ in range(workers)]
        self.load = [0] * workers

    def match(self, w: int, prompt: tuple[int, ...]) -> int:
        best = 0
        for p in self.sent[w]:
            n = 0
            while n < min(len(p), len(prompt)) and p[n] == prompt[n]:
                n += 1
            best = max(best, n)
        return best

    def size(self, w: int) -> int:  # a trie's tokens: its distinct non-empty prefixes
        return len({p[:i] for p in self.sent[w] for i in range(1, len(p) + 1)})

    def choose(self, prompt: tuple[int, ...], up: list[bool]) -> int:
        alive = [w for w in range(len(up)) if up[w]]
        lo, hi = min(self.load[w] for w in alive), max(self.load[w] for w in alive)
        if hi - lo > self.cfg.balance_abs and hi > self.cfg.balance_rel * lo:
            w = min(alive, key=lambda w: (self.load[w], w))
        else:
            best = min(alive, key=lambda w: (-self.match(w, prompt), self.load[w], w))
            if self.match(best, prompt) / len(prompt) > self.cfg.cache_threshold:
                w = best
            else:
                w = min(alive, key=lambda w: (self.size(w), w))
        self.sent[w].append(prompt)
        self.load[w] += 1
        return w


STEP = st.one_of(
    st.tuples(
        st.just("send"),
        st.lists(st.integers(0, 3), min_size=1, max_size=12),
        st.lists(st.booleans(), min_size=3, max_size=3).filter(any),
    ),
    st.tuples(st.just("done"), st.integers(0, 2), st.just([True])),
)


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(STEP, max_size=40), abs_=st.integers(0, 3))
def test_the_gateway_chooses_as_the_documented_policy_does(
    steps: list[tuple[str, object, list[bool]]], abs_: int
) -> None:
    cfg = GatewayConfig(balance_abs=abs_)
    gw, ref = CacheAwareGateway(3, cfg, block_size=2), Reference(3, cfg)
    for t, (kind, arg, up) in enumerate(steps):
        if kind == "done":
            assert isinstance(arg, int)
            if ref.load[arg] > 0:
                ref.load[arg] -= 1
                gw.finished(arg)
            continue
        assert isinstance(arg, list)
        prompt = tuple(arg)
        assert gw.choose(list(prompt), up, float(t)) == ref.choose(prompt, up)
        assert gw.load == ref.load
        assert [tree.total_tokens for tree in gw.trees] == [ref.size(w) for w in range(3)]


# ------------------------------------------------------------------------- in a run
def _config(policy: str, **kw: object) -> ClusterConfig:
    gateway = GatewayConfig() if policy == CACHE_AWARE else None
    base = ClusterConfig(
        nodes=4,
        cost=costs.resolve("cpu-tiny"),
        router=RouterConfig(policy=Policy.NONE if gateway else Policy.parse(policy)),
        gossip=GossipConfig.for_interval(0.1),
        seed=3,
        gateway=gateway,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def _simulate(policy: str, reqs: list[Request], **kw: object):  # type: ignore[no-untyped-def]
    tokenize, _ = byte_tokenize()
    return run(SimSpec(name=policy, cluster=_config(policy, **kw)), reqs, tokenize)


def test_the_gateway_hop_costs_a_forward_each_way() -> None:
    reqs = [Request(id="r0", prompt="one cold prompt " * 20)]
    net = NetworkConfig(delay_s=0.005)
    none = _simulate("none", reqs, network=net).records[0]
    gw = _simulate(CACHE_AWARE, reqs, network=net).records[0]
    hop = costs.resolve("cpu-tiny").forward_overhead_s
    assert gw.policy == CACHE_AWARE and gw.status == 200
    assert gw.latency_s - none.latency_s == pytest.approx(2 * 0.005 + hop)


def test_across_regions_the_client_crosses_to_the_gateway_in_the_first_region() -> None:
    # node 1 is in eu; the gateway stands in us (node 0's region), 40 ms away one way
    net = NetworkConfig(delay_s=0.001, regions=("us", "eu"), region_delay_s=((0.001, 0.04),
                                                                            (0.04, 0.001)))
    reqs = [Request(id="r0", prompt="one cold prompt " * 20, entry=1)]
    none = _simulate("none", reqs, network=net).records[0]
    gw = _simulate(CACHE_AWARE, reqs, network=net).records[0]
    hop = costs.resolve("cpu-tiny").forward_overhead_s
    assert gw.entry_node == "n0"  # all trees empty: the first worker, beside the gateway
    # eu client -> us gateway -> n0 and back: 2 x (40 + 1) ms
    assert gw.latency_s - none.latency_s == pytest.approx(2 * 0.041 + hop)


def test_one_client_behind_the_gateway_keeps_each_prefix_on_one_worker(
    make_reqs: Callable[..., list[Request]],
) -> None:
    reqs = make_reqs(80, groups=6, prefix_words=200)
    res = _simulate(CACHE_AWARE, reqs)
    none = _simulate("none", reqs).summary
    assert res.summary["policy"] == CACHE_AWARE and res.summary["errors"] == 0
    assert res.summary["sim"]["gateway_imbalanced_choices"] == 0
    assert res.summary["sim"]["gateway_balanced_choices"] == len(reqs)
    served: dict[str | None, set[str | None]] = {}
    for r in res.records:
        served.setdefault(r.group, set()).add(r.served_by)
        assert r.served_by == r.entry_node  # the gateway's choice runs there
    assert all(len(nodes) == 1 for nodes in served.values())  # one worker per prefix
    assert res.summary["actual_hit_rate"] > none["actual_hit_rate"]


def test_the_nodes_behind_a_gateway_must_not_route() -> None:
    with pytest.raises(ValueError, match="policy none"):
        _config("cost", gateway=GatewayConfig())


def test_the_simulator_takes_the_gateway_as_a_policy_name() -> None:
    assert parse_policies("none,cost,cache_aware") == ["none", "cost", "cache_aware"]
    with pytest.raises(ValueError):
        parse_policies("cost,sglang")
