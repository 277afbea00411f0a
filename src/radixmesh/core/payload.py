"""The app-state hook of gossip: the versioned per-node state dissemination moves.

Dissemination (``dissemination.py``, ``epidemic.py``) never looks inside it; the cache summary
implements it (``cache_payload.py``), in the spirit of memberlist's LocalState /
MergeRemoteState. Its own module so that both users and the implementation depend on it and
not on each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from radixmesh.core.messages import Change, Delta, Snapshot


class Payload(Protocol):
    """The versioned per-node state that dissemination moves without looking inside."""

    @property
    def version(self) -> int:
        """Our own state's version (grows by one per change)."""

    def local_state(self) -> Snapshot:
        """Our whole state at ``version``."""

    def local_changes(self, base: int) -> Delta | None:
        """Our change entries after ``base``; None if they are no longer all kept."""

    def merge_remote_state(self, peer: str, snap: Snapshot) -> None:
        """Replace what we hold of ``peer`` by its whole (newer) state."""

    def merge_remote_changes(self, peer: str, changes: Sequence[Change]) -> None:
        """Apply ``peer``'s change entries, consecutive and newer than what we hold, in order."""

    def remote_state(self, peer: str, version: int, limit: int) -> Snapshot | None:
        """What we hold of ``peer`` as a snapshot at ``version``; None if over ``limit`` items."""

    def forget_remote(self, peer: str) -> None:
        """Drop what we hold of ``peer`` (it died or restarted)."""

    def remote_size(self, peer: str) -> int:
        """How many items we hold of ``peer``."""
