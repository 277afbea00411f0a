"""Membership and failure detection: who is in the mesh and whether they are alive.

Theory of operation
-------------------
Every known peer is a :class:`Member` in one of three states, moved by a transition table
(anything not in the table is a bug and raises :class:`IllegalTransition`)::

              HEARD                  SILENT(suspect_after)         SILENT(dead_after)
    ALIVE ◀──────────── SUSPECT ◀───────────────────── ALIVE ... SUSPECT ──────────▶ DEAD
      │ FORWARD_FAILED     ▲                                                          │
      └────────────────────┘                        HEARD (came back) ◀──────────────┘

* heartbeat = any message from the peer (or, in epidemic mode, a newer heartbeat counter
  relayed by someone else);
* silent for ``suspect_after_s`` → SUSPECT: not routed to; silent for ``dead_after_s`` → DEAD:
  its estimate is dropped by the node; a failed forward makes it SUSPECT at once;
* a newer incarnation of a node id (a restart) resets the member to ALIVE with no state.

Dead members are kept as tombstones and probed now and then, so that healed partitions and
restarted nodes are found again. Seeds are addresses without an id until someone answers;
each seed carries its backoff (contacts so far, the round it is due again), counted in the
caller's rounds, so a seed that never answers is not contacted every round forever.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum


class MemberState(Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


class MemberEvent(Enum):
    HEARD = "heard"
    SILENT_SUSPECT = "silent_suspect"  # silent for suspect_after_s
    SILENT_DEAD = "silent_dead"  # silent for dead_after_s
    FORWARD_FAILED = "forward_failed"


class IllegalTransition(RuntimeError):
    """A transition that the table does not allow (a bug in the caller)."""


_A, _S, _D = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD
TRANSITIONS: dict[tuple[MemberState, MemberEvent], MemberState] = {
    (_A, MemberEvent.HEARD): _A,
    (_A, MemberEvent.SILENT_SUSPECT): _S,
    (_A, MemberEvent.SILENT_DEAD): _D,
    (_A, MemberEvent.FORWARD_FAILED): _S,
    (_S, MemberEvent.HEARD): _A,
    (_S, MemberEvent.SILENT_DEAD): _D,
    (_S, MemberEvent.FORWARD_FAILED): _S,
    (_D, MemberEvent.HEARD): _A,
    (_D, MemberEvent.FORWARD_FAILED): _D,
}


def next_state(state: MemberState, event: MemberEvent) -> MemberState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"{event.value} is not allowed in state {state.value}") from None


@dataclass(slots=True)
class Member:
    node_id: str
    address: str
    incarnation: int
    state: MemberState
    last_heard: float  # our clock


@dataclass(frozen=True, slots=True)
class Transition:
    node_id: str
    old: MemberState
    new: MemberState


class Membership:
    """The member table of one node (itself excluded) plus its unanswered seed addresses."""

    def __init__(self, self_id: str, seeds: tuple[str, ...] = ()) -> None:
        self.self_id = self_id
        self._members: dict[str, Member] = {}
        self.seeds: list[str] = list(dict.fromkeys(seeds))
        self._seed_tries: dict[str, int] = {}  # seed -> unanswered contacts so far
        self._seed_due: dict[str, int] = {}  # seed -> first round it may be contacted again

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._members

    def __iter__(self) -> Iterator[Member]:
        return iter(self._members.values())

    def __len__(self) -> int:
        return len(self._members)

    def get(self, node_id: str) -> Member | None:
        return self._members.get(node_id)

    def address_of(self, node_id: str) -> str | None:
        """``node_id``'s address (None: not a known member)."""
        member = self.get(node_id)
        return None if member is None else member.address

    def count(self, state: MemberState) -> int:
        return sum(1 for m in self._members.values() if m.state is state)

    def add(self, node_id: str, address: str, incarnation: int, now: float) -> Member:
        """Learn a new node (or a restart of a known one), ALIVE as of ``now``."""
        member = Member(node_id, address, incarnation, MemberState.ALIVE, now)
        self._members[node_id] = member
        return member

    def remove(self, node_id: str) -> None:
        self._members.pop(node_id, None)

    def apply(self, node_id: str, event: MemberEvent, now: float) -> Transition | None:
        """Move ``node_id`` through the table; returns the transition if the state changed."""
        member = self._members[node_id]
        old = member.state
        member.state = next_state(old, event)
        if event is MemberEvent.HEARD:
            member.last_heard = max(member.last_heard, now)
        return None if member.state is old else Transition(node_id, old, member.state)

    def heard(self, node_id: str, now: float) -> Transition | None:
        return self.apply(node_id, MemberEvent.HEARD, now)

    def expire(self, now: float, suspect_after_s: float, dead_after_s: float) -> list[Transition]:
        """Apply the silence timeouts to every member."""
        out: list[Transition] = []
        for m in self._members.values():
            silent = now - m.last_heard
            if m.state is not MemberState.DEAD and silent >= dead_after_s:
                t = self.apply(m.node_id, MemberEvent.SILENT_DEAD, now)
            elif m.state is MemberState.ALIVE and silent >= suspect_after_s:
                t = self.apply(m.node_id, MemberEvent.SILENT_SUSPECT, now)
            else:
                continue
            if t is not None:
                out.append(t)
        return out

    def resolve_seed(self, address: str) -> None:
        """A seed address turned out to belong to a known member."""
        if address in self.seeds:
            self.seeds.remove(address)
        self._seed_tries.pop(address, None)
        self._seed_due.pop(address, None)

    def add_seeds(self, addresses: tuple[str, ...], limit: int) -> list[str]:
        """New seed addresses (not yet seeds nor a member's address), at most ``limit`` seeds
        in all; returns those added, in order."""
        added: list[str] = []
        for address in dict.fromkeys(addresses):
            if len(self.seeds) >= limit:
                break
            if address and address not in self.seeds and not self.address_known(address):
                self.seeds.append(address)
                added.append(address)
        return added

    def seed_ready(self, address: str, round_: int) -> bool:
        """Whether the seed's backoff lets it be contacted in round ``round_``."""
        return round_ >= self._seed_due.get(address, round_)

    def seed_contacted(self, address: str, round_: int, max_wait: int) -> None:
        """One more unanswered contact: the next waits twice as long, at most ``max_wait``."""
        tries = self._seed_tries.get(address, 0) + 1
        self._seed_tries[address] = tries
        self._seed_due[address] = round_ + min(2 ** min(tries - 1, 30), max_wait)

    def address_known(self, address: str) -> bool:
        return any(m.address == address for m in self._members.values())
