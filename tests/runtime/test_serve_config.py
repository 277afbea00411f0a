"""ServeConfig reads its defaults from the core configs and fills every part of NodeConfig."""

from __future__ import annotations

import pytest

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.config import ForwardConfig, GossipConfig, PushbackConfig
from radixmesh.core.estimators import CostPriors
from radixmesh.core.router import RouterConfig
from radixmesh.core.sessions import SessionConfig
from radixmesh.runtime.config import ServeConfig, config_from_mapping


def test_defaults_come_from_the_core() -> None:
    serve, gossip, forward = ServeConfig(), GossipConfig(), ForwardConfig()
    assert (serve.gossip_interval, serve.gossip_fanout) == (gossip.interval_s, gossip.fanout)
    assert serve.gossip_mode == gossip.mode.value
    assert serve.policy == RouterConfig().policy.value
    assert serve.load_bound == RouterConfig().load_bound
    assert serve.pushback_threshold == PushbackConfig().queue_threshold
    assert serve.forward_timeout == forward.silence_timeout_s
    assert serve.connect_timeout == forward.connect_timeout_s


def test_default_node_config_equals_the_core_defaults_but_for_derived_timeouts() -> None:
    node = ServeConfig().node_config(Fingerprint("m", "t", 16), incarnation=1)
    assert node.router == RouterConfig()
    assert node.pushback == PushbackConfig()
    assert node.forward == ForwardConfig()
    assert node.gossip == GossipConfig.for_interval(GossipConfig().interval_s)


def test_pushback_relative_reaches_the_core_and_zero_means_the_threshold_alone() -> None:
    fp = Fingerprint("m", "t", 16)
    assert ServeConfig().pushback_relative == PushbackConfig().relative
    relative = config_from_mapping({"pushback-relative": "3"}).node_config(fp, incarnation=1)
    assert relative.pushback.relative == 3.0
    alone = config_from_mapping({"pushback_relative": 0}).node_config(fp, incarnation=1)
    assert alone.pushback.relative is None
    with pytest.raises(ValueError, match="pushback_relative"):
        ServeConfig(pushback_relative=0.5)


def test_an_emulated_engines_time_scale_stretches_the_routers_windows() -> None:
    """An engine S times slower than its profile sees rates S times lower: the router's
    measuring windows and its smallest worthwhile gain stretch by S, nothing else."""
    fp, core = Fingerprint("m", "t", 16), RouterConfig()
    router = ServeConfig(profile_time_scale=300.0).node_config(fp, incarnation=1).router
    assert router.error_window_s == 300 * core.error_window_s
    assert router.load_window_s == 300 * core.load_window_s
    assert router.replica_window_s == 300 * core.replica_window_s
    assert router.rent_window_s == 300 * core.rent_window_s
    assert router.min_gain_s == pytest.approx(300 * core.min_gain_s)
    assert (router.min_gain_frac, router.near_tie) == (core.min_gain_frac, core.near_tie)
    assert core.stretched(1.0) is core


def test_an_emulated_engines_time_scale_stretches_the_cost_priors() -> None:
    """The speeds and round trip a node assumes before it measured any: S times longer for an
    engine S times slower (the simulator's first requests weigh them unstretched, on its
    unstretched clock); the context scale and the learning rate stay."""
    fp, plain = Fingerprint("m", "t", 16), CostPriors()
    priors = ServeConfig(profile_time_scale=50.0).node_config(fp, incarnation=1).priors
    assert priors.rtt_s == pytest.approx(50 * plain.rtt_s)
    assert priors.prefill_s_per_token == pytest.approx(50 * plain.prefill_s_per_token)
    assert priors.decode_s_per_token == pytest.approx(50 * plain.decode_s_per_token)
    assert priors.prefill_overhead_s == pytest.approx(50 * plain.prefill_overhead_s)
    assert (priors.context_scale, priors.alpha) == (plain.context_scale, plain.alpha)
    assert ServeConfig().node_config(fp, incarnation=1).priors == plain


def test_an_emulated_engines_time_scale_stretches_the_session_margin() -> None:
    """A session's node may be predicted ``--session-margin`` slower and still go first: a
    duration of the profile's, so S times longer for an engine S times slower (at 200x an
    unstretched 0.5 s margin stood for 2.5 ms)."""
    fp = Fingerprint("m", "t", 16)
    sessions = ServeConfig(profile_time_scale=200.0, session_margin=0.25).node_config(
        fp, incarnation=1).sessions
    assert sessions.margin_s == pytest.approx(50.0)
    assert sessions.ttl_s == pytest.approx(200 * SessionConfig().ttl_s)
    assert ServeConfig().node_config(fp, incarnation=1).sessions == SessionConfig()


def test_forward_timeouts_reach_the_core() -> None:
    cfg = config_from_mapping({"forward-timeout": "750ms", "connect_timeout": 0.25})
    node = cfg.node_config(Fingerprint("m", "t", 16), incarnation=1)
    assert node.forward.silence_timeout_s == 0.75
    assert node.forward.connect_timeout_s == 0.25
    assert node.forward.max_peer_attempts == ForwardConfig().max_peer_attempts


def test_engine_kv_blocks_needs_vllm_and_its_block_size() -> None:
    base = {"engine": "vllm", "engine-url": "http://127.0.0.1:1", "tokenizer": "bytes"}
    assert config_from_mapping({**base, "engine-kv-blocks": 48,
                                "engine-block-size": 128}).engine_kv_blocks == 48
    with pytest.raises(ValueError, match="engine-block-size"):
        config_from_mapping({**base, "engine-kv-blocks": 48})
    with pytest.raises(ValueError, match="engine_kv_blocks"):
        config_from_mapping({**base, "engine-kv-blocks": -1})
