"""Benchmark: what forwarding adds to a request on loopback, and how long a node takes to start.

    python -m radixmesh.runtime.bench_forward [--samples 200] [--json] [--net-delay 0]
        [--peer-transport link|http]

Two real nodes (``LocalCluster``). The same short, already cached prompt (1 output token) is
sent to n0 alternately

* executed by n0 itself (``x-radixmesh-hop: 1``), and
* forwarded by n0 to n1 (``x-radixmesh-target: n1``),

so both paths run identical engine work. Figures (medians over ``--samples`` pairs):

``forward_added_ms``         client latency forwarded minus local
``forward_added_net_ms``     the same after subtracting each request's own engine queue+service
                             time (removes engine noise: what HTTP + relay actually add)
``forward_overhead_node_ms`` n0's own measurement (``RequestDone.forward_overhead_s``): time to the
                             peer's result minus the peer's reported handling time
``forward_added_cpu_ms``     CPU time (both nodes, user + system) a forwarded request costs
                             beyond a local one: what the forward adds on an idle machine,
                             and unlike wall time, insensitive to other load on the box
``forward_cpu_entry_ms`` / ``forward_cpu_peer_ms`` / ``local_cpu_ms``  the same CPU per
                             process: a forward on n0 and on n1, a local request on n0
``http_floor_ms``            a bare ``GET /health`` round trip from the same client (what one
                             HTTP exchange costs on this machine right now)
``load_average_1m``          the machine's load when measured (2 cores here: >2 means queuing)
``startup_parallel_s``       spawn -> healthy, two nodes started together (per node, max)
``startup_single_s``         spawn -> healthy for one node restarted alone

Printed as figures, never asserted. Target: ``forward_added_net_ms`` <= 1 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import httpx

from radixmesh.core.headers import (
    HEADER_HOP,
    HEADER_OVERHEAD,
    HEADER_QUEUE,
    HEADER_SERVICE,
    HEADER_TARGET,
)
from radixmesh.runtime.cluster import LocalCluster, served_model

PROMPT = "The following are multiple choice questions (with answers) about anatomy.\n\n" * 2


def _one(client: httpx.Client, url: str, headers: dict[str, str], model: str
         ) -> tuple[float, float, float]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    resp = client.post(url, json=body, headers=headers)
    elapsed = time.perf_counter() - t0
    resp.raise_for_status()
    h = resp.headers
    engine = float(h[HEADER_QUEUE]) + float(h[HEADER_SERVICE])
    overhead = float(h.get(HEADER_OVERHEAD, "nan"))
    return elapsed, engine, overhead


def _health(client: httpx.Client, base: str) -> float:
    t0 = time.perf_counter()
    client.get(base + "/health").raise_for_status()
    return time.perf_counter() - t0


def _cpu_s(pids: list[int | None]) -> float:
    """User + system CPU seconds used so far by these processes (Linux /proc)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def _cpu_per_request(client: httpx.Client, url: str, headers: dict[str, str],
                     pids: list[int | None], n: int, model: str) -> list[float]:
    """CPU seconds per request, for each of ``pids``."""
    before = [_cpu_s([p]) for p in pids]
    for _ in range(n):
        _one(client, url, headers, model)
    return [(_cpu_s([p]) - b) / n for p, b in zip(pids, before, strict=True)]


def measure(samples: int, net_delay: str = "0", peer_transport: str = "link"
            ) -> dict[str, Any]:
    options = {"policy": "none", "gossip_interval": 0.5, "net_delay": net_delay,
               "peer_transport": peer_transport}
    with LocalCluster(2, options, per_node={0: {"threads": 1}, 1: {"threads": 1}}) as cluster:
        parallel = max(n.startup_s or 0.0 for n in cluster.nodes)
        cluster.restart(1)
        single = cluster.nodes[1].startup_s or 0.0
        url = cluster.url(0) + "/v1/completions"
        local_h = {HEADER_HOP: "1"}
        fwd_h = {HEADER_TARGET: "n1"}
        with httpx.Client(timeout=60, trust_env=False) as client:
            model = served_model(cluster)
            local, fwd, floor = _latencies(client, url, local_h, fwd_h, cluster.url(1), samples,
                                           model)
            pids = [n.pid for n in cluster.nodes]
            cpu_local = _cpu_per_request(client, url, local_h, pids, samples, model)
            cpu_fwd = _cpu_per_request(client, url, fwd_h, pids, samples, model)
    return {
        "samples": samples,
        "net_delay": net_delay,
        "peer_transport": peer_transport,
        **_forward_figures(local, fwd, cpu_local, cpu_fwd),
        "http_floor_ms": round(1e3 * statistics.median(floor), 3),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "startup_parallel_s": round(parallel, 2),
        "startup_single_s": round(single, 2),
    }


_Timing = tuple[float, float, float]  # _one's (client seconds, engine seconds, node overhead)


def _latencies(client: httpx.Client, url: str, local_h: dict[str, str],
               fwd_h: dict[str, str], peer: str, samples: int, model: str
               ) -> tuple[list[_Timing], list[_Timing], list[float]]:
    """After a warm-up, ``samples`` of (local request, forwarded request, the peer's
    ``/health`` round trip), interleaved."""
    for _ in range(5):  # warm-up: caches, connections, code paths
        _one(client, url, local_h, model)
        _one(client, url, fwd_h, model)
    local, fwd, floor = [], [], []
    for _ in range(samples):
        local.append(_one(client, url, local_h, model))
        fwd.append(_one(client, url, fwd_h, model))
        floor.append(_health(client, peer))
    return local, fwd, floor


def _forward_figures(local: list[_Timing], fwd: list[_Timing], cpu_local: list[float],
                     cpu_fwd: list[float]) -> dict[str, float]:
    """Medians in milliseconds: what a forward adds to a local request, in time and CPU."""
    med = statistics.median
    return {
        "local_ms": round(1e3 * med(x[0] for x in local), 3),
        "forwarded_ms": round(1e3 * med(x[0] for x in fwd), 3),
        "forward_added_ms": round(1e3 * (med(x[0] for x in fwd) - med(x[0] for x in local)), 3),
        "forward_added_net_ms": round(
            1e3 * (med(x[0] - x[1] for x in fwd) - med(x[0] - x[1] for x in local)), 3),
        "forward_overhead_node_ms": round(1e3 * med(x[2] for x in fwd), 3),
        "forward_added_cpu_ms": round(1e3 * (sum(cpu_fwd) - sum(cpu_local)), 3),
        "forward_cpu_entry_ms": round(1e3 * cpu_fwd[0], 3),
        "forward_cpu_peer_ms": round(1e3 * cpu_fwd[1], 3),
        "local_cpu_ms": round(1e3 * cpu_local[0], 3),
    }


def run(quick: bool = False) -> dict[str, object]:
    """``radixmesh microbench``-style section entry point."""
    return {f"node_{k}": v for k, v in measure(30 if quick else 200).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixmesh.runtime.bench_forward",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--net-delay", default="0", help="emulated one-way delay, e.g. 2ms")
    parser.add_argument("--peer-transport", default="link", choices=("link", "http"),
                        help="how n0 sends its forwards to n1 (the node's --peer-transport)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.samples, args.net_delay, args.peer_transport)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:<28} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
