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
  is never chosen.

Resolving a name (:func:`resolve`). The entry node's own adapter of that name wins (it is
what its ``/v1/models`` lists). Else it asks the mesh: each node advertises its adapters'
(name, digest) pairs with its identity (``Gossip.adapter_names``: first contact, then every
``identity_every`` messages), and a pair counts while the peer's latest keys still hold its
digest. One digest under the name: that one — the entry node forwards the request to a
holder and never runs it itself (:class:`~radixmesh.core.lifecycle.Lifecycle` answers
``RejectRequest`` when no holder takes it). No digest: unknown (a 404 naming it). Several
digests under one name (peers serving different weights under it): ambiguous — refused
(409) unless the request pins a digest (the ``x-radixmesh-adapter-digest`` header), which
then picks the adapter whose key it shares, here or in the mesh.

Pure: the digest of a directory is computed by the shell (``runtime``), from the bytes of its
files; here are the names, keys and tables.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Container, Iterable, Iterator, Mapping
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


def adapters_from_wire(raw: object) -> tuple[Adapter, ...]:
    """``[[name, digest], ...]`` (``Gossip.adapter_names``), checked; ValueError otherwise."""
    if not isinstance(raw, list) or len(raw) > MAX_ADAPTERS:
        raise ValueError(f"at most {MAX_ADAPTERS} [name, digest] pairs")
    pairs = [p for p in raw if isinstance(p, list) and len(p) == 2
             and isinstance(p[0], str) and isinstance(p[1], str)]
    if len(pairs) != len(raw):
        raise ValueError("each is [name, digest]")
    return tuple(Adapter(name, digest) for name, digest in pairs)


def files_digest(files: Iterable[tuple[str, bytes]]) -> str:
    """SHA-256 hex over (relative path, content) pairs, in path order, length-prefixed."""
    h = hashlib.sha256(b"radixmesh adapter v1")
    for path, data in sorted(files):
        name = path.encode("utf-8")
        h.update(len(name).to_bytes(4, "big") + name + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


class UnknownAdapter(LookupError):
    """No node of the mesh serves an adapter of that name (or pinned digest)."""


class AmbiguousAdapter(ValueError):
    """Peers serve different weights under that name, and the request pins none."""


class PeerAdapters:
    """Which adapter keys each peer advertises (its latest gossip wins), and the names it
    gave them (sent with its identity)."""

    def __init__(self) -> None:
        self._by_peer: dict[str, frozenset[int]] = {}
        self._names: dict[str, tuple[Adapter, ...]] = {}

    def learn_names(self, peer: str, adapters: Iterable[Adapter]) -> None:
        self._names[peer] = tuple(adapters)[:MAX_ADAPTERS]

    def named(self, name: str, live: Container[str]) -> set[Adapter]:
        """The adapters ``live`` peers serve now under ``name``."""
        return {a for a in self._served(live) if a.name == name}

    def names(self, live: Container[str]) -> set[str]:
        """Every adapter name some ``live`` peer serves now."""
        return {a.name for a in self._served(live)}

    def _served(self, live: Container[str]) -> Iterator[Adapter]:
        for peer, named in self._names.items():
            if peer in live:
                yield from (a for a in named if self.serves(peer, a.key))

    def learn(self, peer: str, keys: Iterable[int]) -> None:
        keys = frozenset(keys)
        if keys:
            self._by_peer[peer] = keys
        else:
            self._by_peer.pop(peer, None)

    def serves(self, peer: str, key: int) -> bool:
        return key in self._by_peer.get(peer, frozenset())

    def holders(self, key: int) -> list[str]:
        """The peers advertising ``key`` (in id order)."""
        return sorted(p for p, keys in self._by_peer.items() if key in keys)

    def forget(self, peer: str) -> None:
        self._by_peer.pop(peer, None)
        self._names.pop(peer, None)


def resolve(name: str, own: Mapping[str, Adapter], peers: PeerAdapters | None,
            live: Container[str], pin: str | None = None) -> Adapter:
    """The adapter a request naming ``name`` (and pinning digest ``pin``) runs with, here or
    at one of the ``live`` peers (see the module docstring); UnknownAdapter /
    AmbiguousAdapter otherwise."""
    mine = own.get(name)
    mesh = set() if peers is None else peers.named(name, live)
    if pin is not None:
        key = int(pin[:16], 16)
        match = [a for a in ([mine] if mine else []) + sorted(mesh, key=_order) if a.key == key]
        if not match:
            raise UnknownAdapter(f"no node serves adapter {name} of digest {pin}")
        return match[0]
    if mine is not None:
        return mine
    if not mesh:
        raise UnknownAdapter(f"no node serves adapter {name}")
    if len({a.key for a in mesh}) > 1:
        digests = ", ".join(sorted(a.digest for a in mesh))
        raise AmbiguousAdapter(f"peers serve different weights as adapter {name} (digests "
                               f"{digests}); pin one with x-radixmesh-adapter-digest")
    return min(mesh, key=_order)


def _order(a: Adapter) -> str:
    return a.digest


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
