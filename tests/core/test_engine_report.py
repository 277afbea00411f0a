"""An engine's /metrics (core/engine_report.py) and the shadow that follows them
(Shadow.observe): foreign load is what the engine runs beyond the node's open requests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.engine_report import EngineReport, Foreign, parse_metrics, reconcile
from radixmesh.core.profile import resolve
from radixmesh.core.shadow import MAX_GHOSTS, Shadow
from radixmesh.core.shadow_state import ttft_parts

H100 = resolve("h100-llama3-8b")
KV = H100.kv_blocks * H100.block_size

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m",engine="0"}} {r0}
vllm:num_requests_running{{model_name="m",engine="1"}} {r1}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="m",engine="0"}} {w}
vllm:num_requests_waiting{{model_name="m",engine="1"}} 0.0
vllm:kv_cache_usage_perc{{model_name="m",engine="0"}} 0.25
vllm:kv_cache_usage_perc{{model_name="m",engine="1"}} 0.75
vllm:prefix_cache_hits_total{{model_name="m",engine="0"}} 12.0
"""


def test_vllm_gauges_are_summed_over_engine_cores_and_kv_usage_averaged() -> None:
    r = parse_metrics(VLLM.format(r0="3.0", r1="2.0", w="4.0"))
    assert r == EngineReport(running=5, waiting=4, kv_usage=0.5)


def test_older_vllm_and_sglang_names_are_read() -> None:
    old = ("vllm:num_requests_running 1\nvllm:num_requests_waiting 2\n"
           "vllm:gpu_cache_usage_perc 0.5\n")
    assert parse_metrics(old) == EngineReport(1, 2, 0.5)
    sgl = ('sglang:num_running_reqs{model_name="x"} 7\nsglang:num_queue_reqs{model_name="x"} 1\n'
           'sglang:token_usage{model_name="x"} 0.1 1700000000\n')
    assert parse_metrics(sgl) == EngineReport(7, 1, 0.1)


@pytest.mark.parametrize(("text", "field"), [
    ("", "vllm:num_requests_running"),
    ("vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0\n", "vllm:num_requests_waiting"),
    ("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n", "vllm:kv_cache_usage_perc"),
    (VLLM.format(r0="x", r1="0", w="0"), "vllm:num_requests_running"),
    (VLLM.format(r0="1.5", r1="0", w="0"), "vllm:num_requests_running"),
    (VLLM.format(r0="-1", r1="0", w="0"), "vllm:num_requests_running"),
    (VLLM.format(r0="0", r1="0", w="nan"), "vllm:num_requests_waiting"),
    (VLLM.format(r0="0", r1="0", w="1e300"), "vllm:num_requests_waiting"),
    ("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 3\n",
     "vllm:kv_cache_usage_perc"),
])
def test_a_bad_payload_is_refused_naming_the_metric(text: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        parse_metrics(text)


@given(st.binary(max_size=300))
def test_any_bytes_parse_or_raise_value_error(raw: bytes) -> None:
    try:
        report = parse_metrics(raw.decode("utf-8", errors="replace"))
    except ValueError:
        return
    assert report.running >= 0 and report.waiting >= 0 and 0 <= report.kv_usage <= 1


# ----------------------------------------------------------------------------- reconcile
@st.composite
def engines(draw: st.DrawFn) -> tuple[int, int, int, int, int, int, int]:
    """What an engine really holds: foreign running / waiting, this node's running / waiting
    (as the engine has them), this node's requests still on their way there, KV per running
    request, and how many of the node's own waiting ones its shadow has admitted already."""
    fr, fw, orun, ow = (draw(st.integers(0, 40)) for _ in range(4))
    transit = draw(st.integers(0, 5))
    kv_each = draw(st.integers(0, 2000))
    ahead = draw(st.integers(0, ow))
    return fr, fw, orun, ow, transit, kv_each, ahead


@settings(max_examples=300)
@given(engines())
def test_reconcile_finds_exactly_the_foreign_load_when_the_shadow_agrees(
        e: tuple[int, int, int, int, int, int, int]) -> None:
    """The reference: the engine's true requests. With none of the node's in transit and
    the shadow in phase with its engine, the foreign load is recovered exactly; in transit
    requests (the engine's count short) or a shadow ahead only make it smaller, never
    negative, never more than the engine holds."""
    fr, fw, orun, ow, transit, kv_each, ahead = e
    report = EngineReport(fr + orun, fw + ow, min(1.0, (fr + orun) * kv_each / KV))
    exact = reconcile(report, orun + ow, ow, orun * kv_each, KV)
    assert (exact.running, exact.waiting) == (fr, fw)
    if report.kv_usage < 1.0 and fr:
        assert abs(exact.kv_tokens - fr * kv_each) <= 1
    late = reconcile(report, orun + ow + transit, ow - ahead, orun * kv_each, KV)
    assert late.total == max(0, fr + fw - transit)
    assert 0 <= late.running <= report.running and 0 <= late.waiting <= report.waiting
    assert late.waiting <= fw + ahead


# ----------------------------------------------------------------------------- the shadow
def _prompt(i: int, n: int = 600) -> list[int]:
    return [i] * n


def _ttft(shadow: Shadow, now: float) -> float:
    return sum(ttft_parts(shadow.state(now), 512, 0))


def test_foreign_waiting_requests_raise_the_predicted_ttft_and_leave_with_the_report() -> None:
    shadow = Shadow(H100)
    idle = _ttft(shadow, 0.0)
    f = shadow.observe(EngineReport(running=0, waiting=6, kv_usage=0.0), 0.0)
    assert f == Foreign(0, 6, 0)
    state = shadow.state(0.0)
    assert state.running + state.waiting == 6 and shadow.live == 0
    assert _ttft(shadow, 0.0) > idle + 6 * 400 * H100.prefill_token_s
    shadow.observe(EngineReport(0, 0, 0.0), 0.0)  # they are gone at the engine
    assert shadow.state(0.0).waiting == shadow.state(0.0).running == 0
    assert _ttft(shadow, 1.0) == pytest.approx(idle)  # once the step under way has ended


def test_foreign_running_requests_ride_every_step_as_decodes_with_their_kv() -> None:
    shadow = Shadow(H100)
    idle = _ttft(shadow, 0.0)
    shadow.observe(EngineReport(running=50, waiting=0, kv_usage=0.1), 0.0)
    b = shadow.state(0.0)
    assert (b.running, b.decoding) == (50, 50)
    assert b.decode_kv == b.kv_used == round(0.1 * KV)
    assert _ttft(shadow, 0.0) > idle + 50 * H100.decode_seq_s
    # and they slow the shadow's own steps: a prompt takes longer to its first token
    shadow.add(1, _prompt(1), 4, 0.0)
    plain = Shadow(H100)
    plain.add(1, _prompt(1), 4, 0.0)
    assert shadow.state(0.0).residual_s > plain.state(0.0).residual_s


def test_the_nodes_own_requests_are_never_taken_for_foreign_ones() -> None:
    shadow = Shadow(H100)
    for i in range(3):
        shadow.add(i + 1, _prompt(i + 1), 8, 0.0)
    before = shadow.state(0.0)
    assert shadow.observe(EngineReport(running=2, waiting=1, kv_usage=0.05), 0.0).total == 0
    assert shadow.state(0.0) == before
    shadow.forget_foreign(0.0)
    assert shadow.live == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30), st.integers(0, 30),
                          st.floats(0.0, 0.5)), min_size=1, max_size=12))
def test_after_each_report_the_shadow_holds_its_own_plus_the_foreign_load(
        events: list[tuple[int, int, int, float]]) -> None:
    """Reference: the shadow's running + waiting after a report is its own open requests
    plus the foreign load reconcile found (ghosts and ghost decodes), whatever came before."""
    shadow = Shadow(H100)
    now, seq = 0.0, 0
    for adds, running, waiting, usage in events:
        for _ in range(adds):
            seq += 1
            shadow.add(seq, _prompt(seq), 200, now)
        f = shadow.observe(EngineReport(running, waiting, usage), now)
        b = shadow.state(now)
        assert b.running + b.waiting == shadow.live + min(f.total, MAX_GHOSTS)
        assert f.total == max(0, running + waiting - seq)
        now += 0.01
