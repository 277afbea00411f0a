"""The unit of every workload: one client request, independent of how it is sent.

A :class:`Request` carries either a completion ``prompt`` or chat ``messages`` (exactly one),
the output budget, and optional routing/timing hints used by the benchmark runner:
``group`` (the shared-prefix family, e.g. an MMLU subject), ``entry`` (index of the node the
client sends it to; ``None`` = round-robin), ``t`` (arrival time in seconds for open-loop
schedules; ``None`` = send when the previous one finished) and ``after`` (the id of an earlier
request whose answer this one needs first: the previous turn of a conversation, the previous
step of an agent's task; every schedule holds it until that one has finished, see
:class:`radixmesh.workload.schedule.Sessions`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Request:
    id: str
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    max_tokens: int = 1
    group: str | None = None
    entry: int | None = None
    t: float | None = None
    prefix_chars: int | None = None  # length of the group's shared prefix, when known
    after: str | None = None  # id of an earlier request that must finish first

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("request id must be non-empty")
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"request {self.id!r}: give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError(f"request {self.id!r}: messages must be non-empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.id!r}: max_tokens must be >= 1")
        if self.entry is not None and self.entry < 0:
            raise ValueError(f"request {self.id!r}: entry must be >= 0")
        if self.t is not None and self.t < 0:
            raise ValueError(f"request {self.id!r}: t must be >= 0")
        if self.after == self.id:
            raise ValueError(f"request {self.id!r}: cannot wait for itself")

    @property
    def text(self) -> str:
        """All prompt text, concatenated (for character statistics and prefix matching)."""
        if self.prompt is not None:
            return self.prompt
        assert self.messages is not None
        return "".join(m.content for m in self.messages)

    def with_entry(self, entry: int | None) -> Request:
        return replace(self, entry=entry)

    def with_time(self, t: float | None) -> Request:
        return replace(self, t=t)
