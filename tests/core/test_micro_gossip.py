"""The gossip micro-benchmark runs and reports consistent figures (sizes, not timings)."""

from __future__ import annotations

from radixmesh.bench import micro_gossip
from radixmesh.core.config import GossipMode


def test_quick_run_reports_its_figures() -> None:
    figures = micro_gossip.run(quick=True)
    assert figures["snapshot_blocks"] == 100_000
    per_block = figures["snapshot_bytes_per_block"]
    assert isinstance(per_block, float) and 0 < per_block < 8.0  # below raw 64-bit hashes
    idle, churn = figures["delta_bytes_per_s_idle"], figures["delta_bytes_per_s"]
    assert isinstance(idle, float) and isinstance(churn, float)
    assert 0 < idle < churn  # bytes follow churn
    assert figures["delta_churn_changes_per_s"] == 12.0


def test_summary_and_load_gossip_stay_under_one_kilobyte_per_second() -> None:
    """The budget of issue 50 (docs/benchmarks.md, "Gossip encoding and bandwidth"): the
    headline churn, exact byte counts on a virtual clock (a size, not a timing)."""
    rate, blocks = micro_gossip.HEADLINE
    sent = micro_gossip._bytes_per_s(GossipMode.DELTA, rate, blocks, 60.0)
    assert 0 < sent <= 1000.0, sent


def test_a_batching_nodes_batch_report_adds_little_to_its_gossip() -> None:
    """``Load.batch`` (76 bytes) rides a message to a peer only when that peer's copy changed
    materially or is ``BATCH_REFRESH_ROUNDS`` old: at the headline churn it adds under
    100 B/s to a busy node's gossip (with every report ~765 B/s: 1,079 -> 1,844 B/s)."""
    rate, blocks = micro_gossip.HEADLINE
    busy = micro_gossip._bytes_per_s(GossipMode.DELTA, rate, blocks, 60.0, busy=True)
    batch = micro_gossip._bytes_per_s(GossipMode.DELTA, rate, blocks, 60.0, busy=True,
                                      batch=True)
    assert 0 < batch - busy < 100.0, (busy, batch)
