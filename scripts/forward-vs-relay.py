#!/usr/bin/env python3
"""A mesh forward against a gateway's relay hop, on the same box and the same emulated link.

    .venv/bin/python scripts/forward-vs-relay.py [--samples 150] [--net-delay 2ms]
        [--peer-transport link|http]

Two real nodes (``LocalCluster``, tiny preset, one torch thread each) and the delaying relay
the benchmark puts between a centralized gateway and its workers (``bench/linkproxy.py``).
The same short cached prompt (1 output token) goes, in turn:

* ``local``    to n0, executed there (``x-radixmesh-hop: 1``)
* ``forward``  to n0, forwarded to n1 (``x-radixmesh-target: n1``): one mesh hop
* ``direct``   to n1, executed there
* ``relay``    to n1 through the relay: the hop a gateway's request makes, without the
               gateway's own routing (a lower bound on what a gateway adds)

Printed: medians of client latency and of latency outside the engine (less the serving
node's queue and service times), and ``forward - local`` against ``relay - direct``.
Figures only, nothing asserted.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from urllib.parse import urlsplit

import httpx

from radixmesh.core.units import parse_duration
from radixmesh.runtime.bench_forward import _one
from radixmesh.runtime.cluster import LocalCluster


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=150)
    parser.add_argument("--net-delay", default="0", help="emulated one-way delay, e.g. 2ms")
    parser.add_argument("--peer-transport", default="link", choices=("link", "http"),
                        help="how n0 sends its forward to n1 (the node's --peer-transport)")
    args = parser.parse_args()
    delay_s = parse_duration(args.net_delay)
    options = {"policy": "none", "gossip_interval": 0.5, "net_delay": args.net_delay,
               "peer_transport": args.peer_transport}
    with LocalCluster(2, options, per_node={0: {"threads": 1}, 1: {"threads": 1}}) as cluster:
        n1 = urlsplit(cluster.url(1))
        relay = subprocess.Popen(
            [sys.executable, "-m", "radixmesh.bench.linkproxy", "--delay", repr(delay_s),
             "--to", f"{n1.hostname}:{n1.port}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert relay.stdout is not None
            ready = relay.stdout.readline().split()
            if len(ready) != 2 or ready[0] != "READY":
                raise RuntimeError(f"the relay did not start (said {ready})")
            paths = {
                "local": (cluster.url(0), {"x-radixmesh-hop": "1"}),
                "forward": (cluster.url(0), {"x-radixmesh-target": "n1"}),
                "direct": (cluster.url(1), {"x-radixmesh-hop": "1"}),
                "relay": (f"http://127.0.0.1:{ready[1]}", {"x-radixmesh-hop": "1"}),
            }
            seen: dict[str, list[tuple[float, float]]] = {k: [] for k in paths}
            with httpx.Client(timeout=60, trust_env=False) as client:
                for k in range(args.samples + 10):  # the first 10: warm-up
                    for name, (base, headers) in paths.items():
                        elapsed, engine, _ = _one(client, base + "/v1/completions", headers)
                        if k >= 10:
                            seen[name].append((elapsed, elapsed - engine))
        finally:
            relay.terminate()
            relay.wait(timeout=10)
    med = {name: (1e3 * statistics.median(x[0] for x in v),
                  1e3 * statistics.median(x[1] for x in v)) for name, v in seen.items()}
    print(f"net delay {args.net_delay}, peer transport {args.peer_transport}, "
          f"{args.samples} rounds; medians, ms")
    for name, (total, outside) in med.items():
        print(f"  {name:<8} {total:7.2f}   outside the engine {outside:6.2f}")
    print(f"forward - local  {med['forward'][1] - med['local'][1]:6.2f} ms (outside the engine)")
    print(f"relay - direct   {med['relay'][1] - med['direct'][1]:6.2f} ms (outside the engine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
