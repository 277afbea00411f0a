"""Regions on the real-process mesh: which node, client and gateway lives where, and the
one-way delays between them (``radixmesh bench --regions us,eu,ap --region-delays ...``).

Theory of operation
-------------------
The spelling and meaning are the simulator's (``radixmesh sim --regions``, sim/network.py):
region names, and a one-way delay matrix in milliseconds, rows ``;``-separated, row = from,
column = to, the diagonal being the delay inside a region (e.g. ``1,40,90;40,1,120;90,120,1``).
Node ``i`` lives in region ``i mod R`` (round-robin, as in the simulator). Every delay below is
applied by machinery that already exists, ``time_scale`` times longer on an emulated mesh
(bench/emulated.py; figures are divided back)::

    node i -> node j     the node's own per-peer link emulation (runtime/netem.py): node i is
                         started with ``--net-peer-delays ADDR_j=D[ri][rj]/D[rj][ri],...``
                         (``--net-delay`` then applies to nobody)
    client -> node       clients enter in every region: a request entering at node k comes
                         from a client in k's region, which pays D[rk][rk] each way
                         (bench/client.py ``send(..., link=)``)
    client -> gateway    the gateways (sglang-router, SMG) stand in region 0; a client in
                         region r pays D[r][0] there and D[0][r] back
    gateway -> node j    the gateway's delaying relay (bench/linkproxy.py), D[0][rj] out and
                         D[rj][0] back

The oracle (a client-side choice sent through the entry node) pays what the mesh pays.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.core.link import RegionDelays
from radixmesh.runtime.netem import format_peer_delays
from radixmesh.sim.network import parse_regions

GATEWAY_REGION = 0  # the gateways stand in the first region named

Link = tuple[float, float]  # (out, back) one-way delays, seconds


@dataclass(frozen=True, slots=True)
class Regions:
    """Named regions and their one-way delay matrix; node ``i`` in region ``i mod R``."""

    delays: RegionDelays

    @classmethod
    def parse(cls, names: str, matrix_ms: str) -> Regions | None:
        """``--regions`` and ``--region-delays`` (None when no regions are named);
        ValueError naming the flag when the matrix is missing or not R x R."""
        if not names.strip():
            if matrix_ms.strip():
                raise ValueError("--region-delays needs --regions")
            return None
        if not matrix_ms.strip():
            raise ValueError("--regions needs --region-delays (one-way ms, rows ';')")
        try:
            regions, matrix = parse_regions(names, matrix_ms)
            return cls(RegionDelays(regions, matrix))
        except ValueError as exc:
            raise ValueError(f"--region-delays: {exc}") from None

    @property
    def names(self) -> tuple[str, ...]:
        return self.delays.names

    def of(self, node: int) -> int:
        return node % len(self.names)

    def between(self, a: int, b: int) -> Link:
        """Region ``a`` -> region ``b`` and back."""
        d = self.delays.delay_s
        return d[a][b], d[b][a]

    def peer_delays(self, node: int, addresses: list[str], scale: float = 1.0) -> str:
        """``--net-peer-delays`` of ``node`` toward every other node (``addresses`` in node
        order), ``scale`` times longer."""
        links = {}
        for j, address in enumerate(addresses):
            if j != node:
                out, back = self.between(self.of(node), self.of(j))
                links[address] = (out * scale, back * scale)
        return format_peer_delays(links)

    def client_link(self, entry: int, gateway: bool) -> Link:
        """What a client whose request enters at node ``entry`` pays to reach where it sends:
        its region's own delay to that node, or the way to the gateway's region."""
        home = self.of(entry)
        return self.between(home, GATEWAY_REGION if gateway else home)

    def gateway_links(self, nodes: int) -> list[Link]:
        """The gateway's (region 0) links to each node, in node order."""
        return [self.between(GATEWAY_REGION, self.of(j)) for j in range(nodes)]

    def to_json(self) -> dict[str, object]:
        return {"names": list(self.names),
                "delay_ms": [[d * 1000.0 for d in row] for row in self.delays.delay_s],
                "gateway_region": self.names[GATEWAY_REGION]}  # fmt: skip
