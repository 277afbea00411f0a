"""The cache summary as the payload the gossip layer disseminates.

Theory of operation
-------------------
Dissemination (:mod:`dissemination`) moves one opaque, versioned payload per node: it decides
*which* versions travel (snapshot or the change entries after a base, acks, relays) and never
looks inside a change. This module is the cache summary's side of that contract
(:class:`~radixmesh.core.payload.Payload`, in the spirit of memberlist's
``LocalState`` / ``MergeRemoteState`` delegate):

    local_state()           our whole summary          <- LocalSummary.snapshot()
    local_changes(base)     our changes after base     <- LocalSummary.delta_since(base)
    merge_remote_state      a peer's whole summary     -> PeerView.replace
    merge_remote_changes    a peer's newer changes     -> PeerView.apply_delta, in order
    remote_state            what we hold of a peer, as a snapshot to relay (bounded size)
    forget_remote           a peer restarted or died   -> PeerView.drop

A peer's last snapshot (received or rebuilt from the view) is kept until its next change, so
relaying it to many targets costs one scan of the view's index, not one per target.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixmesh.core.cache_summary import LocalSummary
from radixmesh.core.messages import Change, Delta, Snapshot
from radixmesh.core.peerview import PeerView


class CachePayload:
    """Our :class:`LocalSummary` out, peers' summaries into the :class:`PeerView`."""

    def __init__(self, summary: LocalSummary, view: PeerView) -> None:
        self.summary = summary
        self.view = view
        self._snapshots: dict[str, Snapshot] = {}  # per peer, for relaying (see module doc)

    @property
    def version(self) -> int:
        return self.summary.version

    def local_state(self) -> Snapshot:
        return self.summary.snapshot()

    def local_changes(self, base: int) -> Delta | None:
        return self.summary.delta_since(base)

    def merge_remote_state(self, peer: str, snap: Snapshot) -> None:
        self.view.replace(peer, snap.hashes)
        self._snapshots[peer] = snap

    def merge_remote_changes(self, peer: str, changes: Sequence[Change]) -> None:
        for change in changes:
            self.view.apply_delta(peer, change.added, change.removed)
        self._snapshots.pop(peer, None)

    def remote_state(self, peer: str, version: int, limit: int) -> Snapshot | None:
        """What we hold of ``peer`` (at ``version``), or None if over ``limit`` hashes."""
        if self.view.size(peer) > limit:
            return None
        snap = self._snapshots.get(peer)
        if snap is None or snap.version != version:
            snap = self._snapshots[peer] = Snapshot(version, tuple(sorted(self.view.held(peer))))
        return snap

    def forget_remote(self, peer: str) -> None:
        self.view.drop(peer)
        self._snapshots.pop(peer, None)

    def remote_size(self, peer: str) -> int:
        return self.view.size(peer)
