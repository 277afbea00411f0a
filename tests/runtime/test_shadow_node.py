"""A node fronting an external engine with ``--profile`` keeps a shadow of its scheduler
(core/shadow.py): the requests it sends enter it, leave it when the engine ends them, and
the batch it reports reaches its peers by gossip (``Load.batch``); the decision log carries
each candidate's predicted TTFT."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import aiohttp
from test_external_mesh import LIMIT_S, PREFIX, complete
from test_external_mesh import node as mesh_node

from radixmesh.emulate.fake import FakeEngine
from radixmesh.runtime.cluster import free_port
from radixmesh.runtime.node import NodeService

if TYPE_CHECKING:
    from conftest import Poll

@contextlib.asynccontextmanager
async def node(poll: Poll, fake: FakeEngine, name: str, port: int, peer_port: int
               ) -> AsyncIterator[NodeService]:
    """test_external_mesh's node with ``cost`` and the engine's profile (its shadow)."""
    async with mesh_node(poll, fake, name, port, peer_port, policy="cost",
                         profile="h100-llama3-8b") as service:
        yield service


def test_a_profiled_node_shadows_its_engine_and_gossips_its_batch(poll: Poll) -> None:
    async def scenario() -> None:
        fake1, fake2 = FakeEngine(cache_tokens=4096), FakeEngine(cache_tokens=4096)
        await fake1.start()
        await fake2.start()
        p1, p2 = free_port(), free_port()
        try:
            async with (node(poll, fake1, "node-1", p1, p2) as n1,
                        node(poll, fake2, "node-2", p2, p1) as n2,
                        aiohttp.ClientSession() as http):
                assert n1.shadow is not None and n2.shadow is not None
                await poll.until_async(lambda: n1.peer_states() == {"node-2": "alive"},
                                       "the mesh", LIMIT_S)
                status, _, body = await complete(http, p1, PREFIX + "Question 1?")
                assert status == 200, body
                assert n1.shadow.live == 0  # the engine ended it: the shadow dropped it
                gossip = n2.core._parts.gossip

                def batch_seen() -> bool:
                    est = gossip.estimates.get("node-1")
                    return est is not None and est.load is not None and \
                        est.load.batch is not None

                await poll.until_async(batch_seen, "node 1's batch at node 2", LIMIT_S)
                est = gossip.estimates["node-1"]
                assert est.load is not None and est.load.batch is not None
                assert est.load.batch.step_tokens == 8192  # the H100 profile's
                kept = n1.core.decisions.recent()
                assert kept and kept[-1].considered[0].predicted_ttft_s is not None
        finally:
            await fake1.stop()
            await fake2.stop()

    asyncio.run(scenario())
