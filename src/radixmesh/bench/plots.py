"""The report's PNG figures (matplotlib, Agg backend — no display needed).

Every function takes the loaded :class:`~radixmesh.bench.folder.Results` and a path, draws one
figure, and returns False (drawing nothing) when the runs it needs are missing. A figure shows
only what ran: a line needs at least two points (a "latency vs Δcomm" figure needs two Δcomm
values), a panel is drawn only for data that exists (no empty panels).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib import ticker

from radixmesh.bench.folder import OPEN_LOOP, Results, Row
from radixmesh.results.records import Record

WINDOW, STRIDE = 300, 30
COLORS = {"none": "tab:gray", "paper": "tab:orange", "cost": "tab:blue", "oracle": "tab:green",
          "sglang": "tab:red", "random": "tab:purple", "round_robin": "tab:brown",
          "least_loaded": "tab:pink", "llmd": "tab:olive", "smg": "tab:cyan"}  # fmt: skip
DELAYS_MS = (2.0, 200.0, 1000.0)


def _save(fig: Any, path: Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def latency_vs_comm(res: Results, path: Path) -> bool:
    # `none` at each delay (each delay is its own batch, so its own `none`): a folder of the
    # delay batches alone, without the 2 ms one, still draws the curve
    nones = [(ms, r) for ms in DELAYS_MS if (r := res.find("none", delay_ms=ms)) is not None]
    series = {p: [(ms, res.find(p, delay_ms=ms)) for ms in DELAYS_MS]
              for p in ("paper", "cost", "oracle")}  # fmt: skip
    delays = {ms for pts in series.values() for ms, r in pts if r is not None}
    if not nones or len(delays) < 2:  # one Δcomm value is a point, not a curve
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([ms for ms, _ in nones], [r["mean_latency_s"] for _, r in nones], "o--",
             color=COLORS["none"], label="none")  # fmt: skip
    ax2.axhline(1.0, color=COLORS["none"], ls="--", label="none")
    for pol, pts in series.items():
        xs = [ms for ms, r in pts if r is not None]
        if not xs:
            continue
        runs = [r for _, r in pts if r is not None]
        ax1.plot(xs, [r["mean_latency_s"] for r in runs], "o-", color=COLORS[pol], label=pol)
        ratios = [res.ratio(r) for r in runs]
        ax2.plot(xs, [x if x is not None else float("nan") for x in ratios], "o-",
                 color=COLORS[pol], label=pol)  # fmt: skip
    for ax, title in ((ax1, "mean latency (s)"), (ax2, "mean latency / none (paired)")):
        ax.set_xscale("log")
        ax.set_xlabel("Δcomm, one-way (ms)")
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    return _save(fig, path)


def window_for(n: int) -> int:
    return min(WINDOW, max(30, n // 3))


def windows(
    records: Sequence[Record], group: str, nodes: Sequence[str]
) -> tuple[list[int], dict[str, list[float]]]:
    """Per-node share (%) of ``group``'s requests in sliding windows over the request stream
    (window 300 requests, stride 30; a third of the run when it is shorter than 900)."""
    ordered = sorted(records, key=lambda r: r.seq)
    window = window_for(len(ordered))
    xs: list[int] = []
    shares: dict[str, list[float]] = {n: [] for n in nodes}
    for end in range(window, len(ordered) + 1, STRIDE):
        sub = [r for r in ordered[end - window : end] if r.group == group]
        counts = Counter(r.served_by for r in sub)
        xs.append(end)
        for n in nodes:
            shares[n].append(100.0 * counts[n] / len(sub) if sub else float("nan"))
    return xs, shares


def _top_groups(records: Sequence[Record], k: int = 2) -> list[str]:
    counts = Counter(r.group for r in records if r.group)
    return [g for g, _ in counts.most_common(k)]


def _share_grid(res: Results, panels: Sequence[tuple[str, Row]], groups: Sequence[str],
                title: str, path: Path) -> bool:  # fmt: skip
    fig, axes = plt.subplots(len(groups), len(panels), figsize=(3.6 * len(panels), 5.6),
                             squeeze=False, sharey=True)  # fmt: skip
    nodes = sorted({r.served_by for _, run in panels for r in res.ok(run) if r.served_by})
    colors = {n: f"C{i}" for i, n in enumerate(nodes)}
    for col, (label, run) in enumerate(panels):
        recs = res.ok(run)
        for row, group in enumerate(groups):
            ax = axes[row][col]
            xs, shares = windows(recs, group, nodes)
            for node, ys in shares.items():
                ax.plot(xs, ys, label=node, lw=1.2, color=colors[node])
            ax.set_title(f"{label}\n{group}", fontsize=8)
            ax.set_ylim(-5, 105)
            ax.grid(alpha=0.3)
            if row == len(groups) - 1:
                ax.set_xlabel("request index")
            if col == 0:
                ax.set_ylabel("share of subject's requests (%)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def _drawable(panels: list[tuple[str, Row]], res: Results) -> list[tuple[str, Row]]:
    """The panels whose run has at least two windows of requests (a line, not a dot)."""
    out = []
    for label, run in panels:
        n = len(res.ok(run))
        if n >= window_for(n) + STRIDE:
            out.append((label, run))
    return out


def share_over_time(res: Results, path: Path) -> bool:
    cands = [
        ("skewed, paper", res.find("paper", "skewed")),
        ("uniform, paper", res.find("paper")),
        ("uniform, cost", res.find("cost")),
        ("uniform, none", res.find("none")),
        ("uniform, paper, Δpoll 300 s", res.find("paper", gossip_ms=300000.0)),
    ]
    panels = _drawable([(label, r) for label, r in cands if r is not None], res)
    if not panels:
        return False
    groups = _top_groups(res.ok(panels[0][1]))
    if not groups:
        return False
    w = window_for(len(res.ok(panels[0][1])))
    title = f"Per-node share of two subjects' requests (window {w}, stride {STRIDE} requests)"
    return _share_grid(res, panels, groups, title, path)


def specialization_eviction(res: Results, path: Path) -> bool:
    if res.pressure is None:
        return False
    cands = [(f"{p}, cache {res.pressure:,} tok/node", res.find(p, cache=res.pressure))
             for p in ("paper", "cost", "none")]  # fmt: skip
    panels = _drawable([(label, r) for label, r in cands if r is not None], res)
    if not panels:
        return False
    groups = _top_groups(res.ok(panels[0][1]))
    if not groups:
        return False
    w = window_for(len(res.ok(panels[0][1])))
    title = f"Specialization–eviction under memory pressure (window {w}, stride {STRIDE})"
    return _share_grid(res, panels, groups, title, path)


def hit_rates(res: Results, path: Path) -> bool:
    pols = ["none", "paper", "cost", "oracle", "random", "round_robin", "least_loaded", "sglang",
            "smg"]  # fmt: skip
    panels = []
    for skew in ("uniform", "skewed"):
        runs = [(p, r) for p, r in ((p, res.find(p, skew)) for p in pols) if r is not None]
        if runs:  # a panel only for a skew that ran
            panels.append((skew, runs))
    if sum(len(runs) for _, runs in panels) < 2:  # one policy: nothing to compare
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), sharey=True,
                             squeeze=False)
    for ax, (skew, runs) in zip(axes[0], panels, strict=True):
        xs = range(len(runs))
        ax.bar([x - 0.2 for x in xs], [100 * (r["expected_hit_rate"] or 0) for _, r in runs],
               0.4, label="expected (router)", color="tab:cyan")  # fmt: skip
        ax.bar([x + 0.2 for x in xs], [100 * (r["actual_hit_rate"] or 0) for _, r in runs],
               0.4, label="actual (engine)", color="tab:blue")  # fmt: skip
        ax.set_xticks(list(xs), [p for p, _ in runs], rotation=30, fontsize=8)
        ax.set_title(f"{skew}: cache-hit rate (% of prompt tokens)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def _cdf_panels(res: Results) -> dict[str, list[tuple[str, list[float]]]]:
    """Open-loop runs by workload and schedule: each policy's TTFTs (ms, sorted, warm-up out)."""
    panels: dict[str, list[tuple[str, list[float]]]] = {}
    for r in res.runs:
        ttfts = sorted(1000 * x.ttft_s for x in res.ok(r) if x.ttft_s is not None)
        if not ttfts or r.get("schedule") not in (*OPEN_LOOP, "bursty"):
            continue
        key = f"{r.get('workload_kind') or r['workload']}, {r['schedule']}"
        panels.setdefault(key, []).append((r["policy"], ttfts))
    order = sorted(panels, key=lambda k: (k.split(",")[0], "poisson" not in k, k))
    return {k: panels[k] for k in order if len(panels[k]) >= 2}


def ttft_cdf(res: Results, path: Path, title: str = "") -> bool:
    """One panel per workload × arrival schedule, one TTFT CDF per policy (log time axis:
    mixed hardware spans tens of ms to seconds)."""
    panels = _cdf_panels(res)
    if not panels:  # one policy (or no TTFTs): nothing to compare
        return False
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, (key, curves) in zip(axes.flat, panels.items(), strict=False):
        for pol, ttfts in curves:
            ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax.step(ttfts, ys, where="post", color=COLORS.get(pol), label=pol,
                    lw=2.0 if pol == "cost" else 1.2)  # fmt: skip
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("TTFT (ms, unscaled)")
        ax.set_ylabel("share of requests")
        ax.set_title(key, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    return _save(fig, path)
