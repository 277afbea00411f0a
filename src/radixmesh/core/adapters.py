"""LoRA adapters: named by what they contain, advertised in gossip, a hard routing constraint.

Theory of operation
-------------------
A request names an adapter by its *served name* (its ``model``, as vLLM's ``--lora-modules
NAME=PATH``). Names are not identities: two nodes may serve different weights under one name.
So an adapter is known by its **content digest** (``Adapter.digest``: SHA-256 hex of its
files, or given), and:

* its KV never mixes with another adapter's or the base model's: the request's cache
  namespace includes the digest (``core/tenants.Namespacer.namespace_id``);
* each node advertises the 64-bit keys of the digests it serves (``Gossip.adapters``, at most
  ``MAX_ADAPTERS``), and routing keeps only the peers that advertise the request's key
  (:class:`PeerAdapters`, ``core/routing.py``): a peer with other weights under the same name
  is never chosen. The entry node resolves the name against the adapters its own engine
  serves (an unknown name is a 404 there): it is always a holder.

Pure: the digest of a directory is computed by the shell (``runtime``), from the bytes of its
files; here are the names, keys and tables.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MAX_ADAPTERS = 256  # keys one gossip message may advertise
_NAME_RE = re.compile(r"[A-Za-z0-9._:/@\-]{1,128}")
_DIGEST_RE = re.compile(r"[0-9a-f]{16,64}")


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str  # the served name clients put in ``model``
    digest: str  # hex of its content's SHA-256 (16..64 digits)

    def __post_init__(self) -> None:
        if not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"adapter name {self.name!r}: 1-128 of A-Z a-z 0-9 . _ : / @ -")
        if not _DIGEST_RE.fullmatch(self.digest):
            raise ValueError(f"adapter {self.name}: digest must be 16-64 lowercase hex digits")

    @property
    def key(self) -> int:
        """The 64-bit key advertised in gossip."""
        return int(self.digest[:16], 16)


def files_digest(files: Iterable[tuple[str, bytes]]) -> str:
    """SHA-256 hex over (relative path, content) pairs, in path order, length-prefixed."""
    h = hashlib.sha256(b"radixmesh adapter v1")
    for path, data in sorted(files):
        name = path.encode("utf-8")
        h.update(len(name).to_bytes(4, "big") + name + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


class PeerAdapters:
    """Which adapter keys each peer advertises (its latest gossip wins)."""

    def __init__(self) -> None:
        self._by_peer: dict[str, frozenset[int]] = {}

    def learn(self, peer: str, keys: Iterable[int]) -> None:
        keys = frozenset(keys)
        if keys:
            self._by_peer[peer] = keys
        else:
            self._by_peer.pop(peer, None)

    def serves(self, peer: str, key: int) -> bool:
        return key in self._by_peer.get(peer, frozenset())

    def forget(self, peer: str) -> None:
        self._by_peer.pop(peer, None)


def by_name(adapters: Iterable[Adapter]) -> Mapping[str, Adapter]:
    """{served name: adapter}; ValueError for a name listed twice."""
    out: dict[str, Adapter] = {}
    for a in adapters:
        if a.name in out:
            raise ValueError(f"adapter {a.name} is listed twice")
        out[a.name] = a
    return out


def parse_adapter_spec(text: str) -> list[tuple[str, str]]:
    """``NAME=VALUE[,NAME=VALUE...]`` (``--adapters``) as (name, value) pairs; VALUE is a digest
    (16-64 hex digits, optionally ``sha256:``) or an adapter directory (the shell reads it)."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"--adapters: expected NAME=DIGEST or NAME=DIR, got {item!r}")
        pairs.append((name.strip(), value.strip()))
    return pairs


def given_digest(value: str) -> str | None:
    """The digest ``value`` states (``sha256:HEX`` or ``HEX``), None if it is not one."""
    hexpart = value.removeprefix("sha256:")
    return hexpart if _DIGEST_RE.fullmatch(hexpart) else None
