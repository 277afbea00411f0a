"""What a peer's ``ForwardAdmitted`` says it has cached: its index match at acceptance, the
same figure a local request's stream carries in ``x-radixmesh-cached-tokens`` (one meaning
of the header, whichever route served the request).

The peer's admission decision prices the forward with what it will have cached when it runs
it (``QueuedBlocks.cached_when_run``: a queued request of the same prefix computes it first);
that prediction stays inside the node. Real vLLM at 16 in flight showed why the reply must
not carry it: the bench's mismatch classifier (bench/mismatch.py) replays the engine's events
and found no moment at which the serving node's index held what the forwarded request's
header claimed (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from radixmesh.core.forward_codec import ReplyDecoder
from radixmesh.core.messages import ForwardAdmitted, ForwardRequest
from radixmesh.engine.base import match_in
from radixmesh.engine.testing import ScriptedEngine
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.inprocess import free_port
from radixmesh.runtime.node import NodeService

if TYPE_CHECKING:
    from conftest import Poll

# several mesh blocks, and a text no other test of this module's engine has cached
PROMPT = tuple(b"A forward accepted while the same prefix waits in the queue. " * 3)


async def _first_reply(node: NodeService, req: ForwardRequest) -> tuple[object, Any]:
    """The first reply of a forward, and the rest of its stream consumed in the background
    (its engine work queued on ``node`` until it ends)."""
    replies = node.serve_forward(req)
    [first] = ReplyDecoder().feed(await anext(replies))

    async def rest() -> None:
        async for _ in replies:
            pass

    return first, asyncio.ensure_future(rest())


def test_a_forward_is_accepted_with_the_index_match_not_the_queued_prefix(
    engine: Any, poll: Poll,
) -> None:
    async def scenario() -> tuple[int, int, int]:
        # its tokens come 50 ms apart and it never touches the cache: the prefix stays queued
        scripted = ScriptedEngine(engine, "abcdefgh", 0.05)
        node = NodeService(ServeConfig(node_id="peer", port=free_port(), gossip_interval=5.0),
                           scripted)
        await node.start()
        tasks = []
        try:
            req = ForwardRequest(PROMPT, 8, heartbeat_s=0.1)
            _, running = await _first_reply(node, req)
            tasks.append(running)
            await poll.until_async(lambda: node.queue_depth == 1, "the first forward queued")
            second, rest = await _first_reply(node, req)
            tasks.append(rest)
            assert isinstance(second, ForwardAdmitted)
            queued = node.core.local_hashes() - node.core.cached_hashes()
            return second.cached_tokens, match_in(node.engine, PROMPT, None), len(queued)
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await node.stop()

    accepted, index, queued_blocks = asyncio.run(scenario())
    assert queued_blocks > 0  # the prefix is queued here: cached_when_run would count it
    assert index == 0
    assert accepted == index
