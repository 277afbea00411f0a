"""Session affinity: OpenAI's ``prompt_cache_key`` (or ``x-session-id``) as a routing hint.

Theory of operation
-------------------
A multi-turn chat resends its whole history each turn; the node that served the last turn
holds it. A client that names its session (``prompt_cache_key``, or the ``x-session-id``
header) asks that the next turn go there. The shell turns the key into a 64-bit *session id*,
a keyed hash scoped to the caller's tenant (``core/tenants.Namespacer.keyed``: tenant B's
"chat-1" is never tenant A's, and an observer without the cluster key cannot test guessed
keys against gossip), and puts it in ``RequestArrived.session`` and forwards.

Every node keeps a bounded :class:`SessionTable`: session id -> (node that served it last,
when), learned three ways, newest wins:

* its own routing: the node a forward was accepted by, or this node when it runs it;
* its own service: the sessions it served, for entry nodes and forwards alike (``served``);
* gossip: each message carries the ids of the sessions its sender served most recently
  (``recent``: at most ``max_gossip`` ids of the last ``ttl_s``, 8 bytes each packed — a line
  of its own in the gossip budget), which the receiver files under the sender.

No central store: a node that never heard of a session routes it as any other request.

The hint (:meth:`SessionTable.prefer`, the routing hook): after the normal ranking, the
session's node goes first unless it is unavailable or the cost model predicts it slower than
the head of the ranking by more than ``margin_s`` (``SessionConfig.margin_s``, default 0.5 s);
for policies without predictions (``paper``, baselines) it goes first whenever it is a
candidate or an available peer. Entries expire after ``ttl_s`` and the table keeps at most
``capacity`` (least recently seen dropped). Pure: ``now`` is an argument.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from radixmesh.core.cost_model import Candidate
from radixmesh.core.events import Action, ExecuteLocally, Forward

MAX_GOSSIP_SESSIONS = 256  # what a decoder accepts in one message


@dataclass(frozen=True, slots=True)
class SessionConfig:
    margin_s: float = 0.5  # the session's node may be predicted this much slower, still first
    ttl_s: float = 600.0  # an entry older than this is forgotten
    capacity: int = 100_000  # entries kept, least recently seen dropped first
    max_gossip: int = 64  # session ids per gossip message (0: none gossiped)

    def stretched(self, scale: float) -> SessionConfig:
        """This configuration for an engine ``scale`` times slower than its profile (an
        emulated mesh's ``--time-scale``, as ``RouterConfig.stretched``): the margin and the
        time to live ``scale`` times longer (``1``: itself)."""
        if scale == 1.0:
            return self
        return replace(self, margin_s=self.margin_s * scale, ttl_s=self.ttl_s * scale)

    def __post_init__(self) -> None:
        if not self.margin_s >= 0 or not self.ttl_s > 0:
            raise ValueError("margin_s must be >= 0 and ttl_s > 0")
        if self.capacity < 1 or not 0 <= self.max_gossip <= MAX_GOSSIP_SESSIONS:
            raise ValueError(f"capacity must be >= 1, max_gossip in [0, {MAX_GOSSIP_SESSIONS}]")


class SessionTable:
    """Session id -> the node that served it last (see the module docstring)."""

    def __init__(self, node_id: str, config: SessionConfig | None = None) -> None:
        self.node_id = node_id
        self.config = config or SessionConfig()
        self._where: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._mine: OrderedDict[int, float] = OrderedDict()  # sessions served here, newest last
        self.hints_followed = 0
        self.hints_overruled = 0

    def __len__(self) -> int:
        return len(self._where)

    def note(self, session: int, node_id: str, now: float) -> None:
        """``node_id`` serves ``session`` now."""
        self._where[session] = (node_id, now)
        self._where.move_to_end(session)
        while len(self._where) > self.config.capacity:
            self._where.popitem(last=False)

    def served(self, session: int, now: float) -> None:
        """This node served ``session`` (for its peers, too): remembered and gossiped."""
        self.note(session, self.node_id, now)
        self._mine[session] = now
        self._mine.move_to_end(session)
        while len(self._mine) > max(self.config.max_gossip, 1):
            self._mine.popitem(last=False)

    def learn(self, sender: str, sessions: Iterable[int], now: float) -> None:
        """A peer's gossip: it served these sessions lately."""
        for session in sessions:
            self.note(session, sender, now)

    def where(self, session: int, now: float) -> str | None:
        """The node that served ``session`` last, if known and fresh."""
        entry = self._where.get(session)
        if entry is None:
            return None
        if now - entry[1] > self.config.ttl_s:
            del self._where[session]
            return None
        return entry[0]

    def recent(self, now: float) -> tuple[int, ...]:
        """The ids to gossip: sessions served here within ``ttl_s``, newest first."""
        if self.config.max_gossip == 0:
            return ()
        fresh = [s for s, t in reversed(self._mine.items()) if now - t <= self.config.ttl_s]
        return tuple(fresh[: self.config.max_gossip])

    def prefer(self, ranked: list[Candidate], session: int, now: float, predicted: bool,
               available: Callable[[str], bool]) -> list[Candidate]:
        """``ranked`` with the session's node first when the hint holds (module docstring);
        ``predicted``: the ranking's latencies are the cost model's."""
        node = self.where(session, now)
        if node is None or not ranked or ranked[0].node_id == node:
            return ranked
        pick = next((c for c in ranked if c.node_id == node), None)
        if pick is None:
            if predicted or node == self.node_id or not available(node):
                self.hints_overruled += 1
                return ranked
            pick = Candidate(node, False, 0, 0.0)
        elif predicted and (pick.predicted_latency_s - ranked[0].predicted_latency_s
                            > self.config.margin_s):
            self.hints_overruled += 1
            return ranked
        self.hints_followed += 1
        return [pick, *(c for c in ranked if c is not pick)]


def observe_sessions(table: SessionTable, session_of: Callable[[int], int | None],
                     actions: Iterable[Action], now: float) -> None:
    """Learn from a request's next step where its session goes: a forward to a peer, or this
    node (``session_of``: a request's session id, from its flight)."""
    for action in actions:
        if isinstance(action, Forward | ExecuteLocally):
            session = session_of(action.rid)
            if session is None:
                continue
            if isinstance(action, Forward):
                table.note(session, action.peer_id, now)
            else:
                table.served(session, now)
