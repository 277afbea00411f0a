"""PNG figures of the simulator's experiments (matplotlib, headless)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from radixmesh.results.run_summary import Row


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_experiment(name: str, rows: Sequence[Row], out: Path) -> list[Path]:
    if name == "convergence":
        return [convergence_plot(rows, out / "scale_convergence.png")]
    if name == "breakeven":
        return [breakeven_plot(rows, out / "scale_breakeven.png")]
    if name == "scale":
        paths = [hotspot_plot(rows, out / "scale_hotspot.png")]
        if any(r["policy"] == "none" for r in rows):  # the ratio figure needs its baseline
            paths.insert(0, scale_plot(rows, out / "scale_latency_ratio.png"))
        return paths
    if name == "pushback":
        return [pushback_plot(rows, out / "scale_pushback.png")]
    return []


def convergence_plot(rows: Sequence[Row], path: Path) -> Path:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, rs in sorted(_group(rows, lambda r: r["mode"]).items()):
        rs = sorted(rs, key=lambda r: r["nodes"])
        n = [r["nodes"] for r in rs]
        ax1.plot(n, [r["converge_max_s"] for r in rs], marker="o", label=f"{mode}: last node")
        ax1.plot(n, [r["converge_p50_s"] for r in rs], marker="x", ls="--", label=f"{mode}: median")
        ax2.plot(n, [r["idle_bytes_per_node_s"] for r in rs], marker="o", label=mode)
    interval = rows[0]["interval_s"] if rows else 1.0
    ax1.set(
        xscale="log",
        xlabel="nodes",
        ylabel="seconds after the change",
        title=f"Convergence of one cache change (Δpoll {interval:g} s)",
    )
    ax2.set(
        xscale="log",
        yscale="log",
        xlabel="nodes",
        ylabel="bytes / node / s",
        title="Idle gossip bandwidth per node",
    )
    return _save(plt, fig, (ax1, ax2), path)


def breakeven_plot(rows: Sequence[Row], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for model, rs in sorted(_group(rows, lambda r: r["cost_model"]).items()):
        _plot_breakeven_model(ax, model, rs)
    for ms, label in ((2, "LAN 2 ms"), (200, "cross-region 200 ms")):
        ax.axhline(ms, color="grey", ls=":", lw=1)
        ax.text(ax.get_xlim()[0] if ax.get_xlim()[0] > 0 else 256, ms * 1.1, label, fontsize=7)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="prompt tokens (85% shared prefix)",
        ylabel="break-even one-way delay (ms)",
        title="Forwarding pays below the line",
    )
    return _save(plt, fig, (ax,), path)


def _group(rows: Sequence[Row], key: Callable[[Row], Any]) -> dict[Any, list[Row]]:
    """``rows`` by ``key(row)``, in their order within each group."""
    groups: dict[Any, list[Row]] = defaultdict(list)
    for r in rows:
        groups[key(r)].append(r)
    return groups


def _plot_breakeven_model(ax: Any, model: str, rs: list[Row]) -> None:
    """One model's analytic break-even line and, in the same colour, its simulated points."""
    analytic = sorted(
        (r for r in rs if r.get("kind", "analytic") == "analytic"),
        key=lambda r: r["prompt_tokens"],
    )
    line = ax.plot(
        [r["prompt_tokens"] for r in analytic],
        [1e3 * r["breakeven_one_way_s_cold_local"] for r in analytic],
        marker="o",
        label=f"{model}: warm peer vs cold local",
    )
    sims = sorted(
        (
            r
            for r in rs
            if r.get("kind") == "simulated" and r.get("simulated_breakeven_s") is not None
        ),
        key=lambda r: r["prompt_tokens"],
    )
    if sims:
        ax.plot(
            [r["prompt_tokens"] for r in sims],
            [1e3 * r["simulated_breakeven_s"] for r in sims],
            marker="x",
            ls="--",
            color=line[0].get_color(),
            label=f"{model}: paper vs none (simulated)",
        )


def _ratio_series(rows: Sequence[Row], key: str) -> dict[tuple[str, str], list[tuple[int, float]]]:
    base = {(r["nodes"], r["skew"]): r for r in rows if r["policy"] == "none"}
    series: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        b = base.get((r["nodes"], r["skew"]))
        if r["policy"] == "none" or b is None or not b.get(key) or r.get(key) is None:
            continue
        series[(r["policy"], r["skew"])].append((r["nodes"], r[key] / b[key]))
    return series


def scale_plot(rows: Sequence[Row], path: Path) -> Path:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((ax1, "mean_latency_s", "mean"), (ax2, "p99_latency_s", "p99")):
        for (policy, skew), pts in sorted(_ratio_series(rows, key).items()):
            pts.sort()
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                ls="-" if skew == "uniform" else "--",
                label=f"{policy}, {skew}",
            )
        ax.axhline(1.0, color="grey", lw=1)
        ax.set(
            xscale="log",
            xlabel="nodes",
            ylabel=f"{title} latency / none",
            title=f"{title} latency relative to no routing",
        )
    return _save(plt, fig, (ax1, ax2), path)


def hotspot_plot(rows: Sequence[Row], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    groups = _group(rows, lambda r: (r["policy"], r["skew"]))
    for (policy, skew), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["nodes"])
        ax.plot(
            [r["nodes"] for r in rs],
            [r["hotspot_share"] * r["nodes"] for r in rs],
            marker="o",
            ls="-" if skew == "uniform" else "--",
            label=f"{policy}, {skew}",
        )
    ax.axhline(1.0, color="grey", lw=1)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="nodes",
        ylabel="busiest node's share x N (1 = even)",
        title="Hotspot concentration",
    )
    return _save(plt, fig, (ax,), path)


def pushback_plot(rows: Sequence[Row], path: Path) -> Path:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    groups = _group(rows, lambda r: (r["policy"], r["pushback"]))
    for (policy, pb), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["nodes"])
        n = [r["nodes"] for r in rs]
        ls = "-" if pb == "on" else "--"
        ax1.plot(
            n,
            [r["hotspot_share"] * r["nodes"] for r in rs],
            marker="o",
            ls=ls,
            label=f"{policy}, push-back {pb}",
        )
        ax2.plot(
            n,
            [r["p99_latency_s"] for r in rs],
            marker="o",
            ls=ls,
            label=f"{policy}, push-back {pb}",
        )
    ax1.set(
        xscale="log",
        yscale="log",
        xlabel="nodes",
        ylabel="busiest share x N",
        title="Hotspot near saturation",
    )
    ax2.set(
        xscale="log",
        yscale="log",
        xlabel="nodes",
        ylabel="p99 latency (s)",
        title="Tail latency near saturation",
    )
    return _save(plt, fig, (ax1, ax2), path)


def _save(plt: Any, fig: Any, axes: Sequence[Any], path: Path) -> Path:
    """The common finish of every figure: light grid, small legend, tight layout, 110 dpi."""
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # (a legend of nothing warns)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
