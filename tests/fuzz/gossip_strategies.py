"""Hypothesis strategies for peer messages, shared by the fuzz tests."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.estimators import SpeedReport
from radixmesh.core.messages import (
    Ack,
    Change,
    Delta,
    DigestEntry,
    Echo,
    Gossip,
    Load,
    NodeState,
    PeerAddress,
    Snapshot,
)

# ------------------------------------------------------------------------ valid messages

u63 = st.integers(min_value=0, max_value=2**63 - 1)
small = st.integers(min_value=0, max_value=1_000)
ident = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=24
)
finite = st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False, width=32)
hashes = st.lists(st.integers(0, 2**64 - 1), max_size=40, unique=True).map(
    lambda xs: tuple(sorted(xs))
)
speed = st.builds(SpeedReport, finite, finite, finite, finite)
percent = st.integers(0, 100).map(lambda p: p / 100)  # utilization travels in whole percent
load = st.builds(Load, small, small, u63, u63, st.none() | speed, st.none() | finite, percent)
snapshot = st.builds(Snapshot, u63, hashes)


@st.composite
def delta(draw: st.DrawFn) -> Delta:
    base = draw(st.integers(0, 2**40))
    n = draw(st.integers(0, 4))
    changes = tuple(
        Change(base + 1 + i, draw(hashes), draw(hashes)) for i in range(n)
    )
    return Delta(base, changes)


summary = st.none() | snapshot | delta()
fingerprint = st.none() | st.builds(Fingerprint, ident, ident, st.integers(1, 4096))


def gossip_strategy(
    senders: st.SearchStrategy[str] | None = None,
    fingerprints: st.SearchStrategy[int] | None = None,
    ids: st.SearchStrategy[str] | None = None,
) -> st.SearchStrategy[Gossip]:
    """Valid messages; ``senders``, ``fingerprints`` and ``ids`` (peer ids) narrow fields."""
    peer_id = ident if ids is None else ids
    relay = st.builds(NodeState, peer_id, ident, u63, u63, finite, st.none() | load, summary)
    messages = st.builds(
        Gossip,
        sender=ident if senders is None else senders,
        address=ident,
        incarnation=u63,
        version=u63,
        heartbeat=u63,
        fingerprint=st.integers(0, 2**64 - 1) if fingerprints is None else fingerprints,
        stamp=finite,
        load=load,
        summary=summary,
        fingerprint_detail=fingerprint,
        ack=st.none() | st.builds(Ack, u63, u63),
        echo=st.none() | st.builds(Echo, finite, finite),
        peers=st.lists(st.builds(PeerAddress, peer_id, ident), max_size=4).map(tuple),
        digest=st.lists(
            st.builds(DigestEntry, peer_id, u63, st.none() | u63, u63), max_size=4
        ).map(tuple),
        relays=st.lists(relay, max_size=3).map(tuple),
        reply=st.booleans(),
    )
    if fingerprints is not None:  # (messages a receiver must accept: with their identity)
        return messages
    # protocol 3: a sender the receiver acknowledged leaves its address and fingerprint out
    return st.tuples(messages, st.booleans()).map(
        lambda m: replace(m[0], address=None, fingerprint=None) if m[1] else m[0])
