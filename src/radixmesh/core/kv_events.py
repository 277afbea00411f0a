"""KV-cache events of external engines (vLLM, SGLang): the payloads and the events in them.

Theory of operation
-------------------
An engine publishes what enters and leaves its prefix cache on a ZMQ PUB socket, one message
of three frames per scheduler step: ``[topic, seq, payload]``. ``seq`` is an 8-byte big-endian
counter that restarts at 0 with the engine. ``payload`` is msgpack: a batch ``[ts, events,
rank]`` (vLLM's data-parallel rank, SGLang's attention-DP rank; absent when unset) or the same
as a map. Each event is either a tagged array (older vLLM: ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium]``, trailing defaults omitted) or a
map with a ``"type"`` (newer vLLM and SGLang; fields absent or nil when None, unknown fields
ignored). What vLLM 0.32 really sends is kept in ``tests/fixtures/vllm_0_32/`` (captured by
``make vllm-check``): ``[ts, events, 0]``, maps with ``lora_id``/``lora_name`` nil,
``extra_keys: [nil, ...]``, ``group_idx``, ``kv_cache_spec_kind: "full_attention"``,
``medium: "GPU"`` (on its CPU build too).
Event types we do not know decode to :class:`UnknownEngineEvent`, which the index counts and
skips. Block hashes are normalised: ints (signed or unsigned 64-bit) to their unsigned 64-bit
pattern, bytes kept as bytes — they are only ever engine-side names, never mesh keys.

Decoding treats every byte as hostile, as :mod:`codec` does: msgpack's own limits bound
strings, arrays and maps before anything is allocated, then each field is checked by hand
(bools are not ints, token ids are uint32, lengths agree, a batch holds at most ``max_tokens``
token ids and ``max_hashes`` hashes in total). Anything wrong raises
:class:`~radixmesh.core.codec.RemoteProtocolError` with a reason, and nothing else. A batch
that fails to decode is lost; the safe reaction of a shell is to drop that engine's index
(it under-reports afterwards, which costs cache misses, never a wrong answer).

Frames and their order (the ZMQ framing, seq numbers, replays,
:class:`~radixmesh.core.kv_order.SequenceTracker`) are :mod:`radixmesh.core.kv_order`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixmesh.core.checked import RemoteProtocolError, unpack_checked

EngineHash = int | bytes  # an engine's name for one of its blocks (normalised)
_U64 = 2**64 - 1
_I64_MIN = -(2**63)
_TOKEN_MAX = 2**32 - 1


@dataclass(frozen=True, slots=True)
class KvLimits:
    """Hard limits on one event batch from an engine."""

    max_payload_bytes: int = 16 * 1024 * 1024
    max_events: int = 65_536
    max_tokens: int = 4 * 1024 * 1024  # token ids over all events of the batch
    max_hashes: int = 262_144  # block hashes over all events of the batch
    max_hash_bytes: int = 64
    max_str_len: int = 4096  # any string, incl. unknown fields
    max_map_len: int = 64

    def __post_init__(self) -> None:
        values = (self.max_payload_bytes, self.max_events, self.max_tokens, self.max_hashes)
        if min(*values, self.max_hash_bytes, self.max_str_len, self.max_map_len) < 1:
            raise ValueError("kv event limits must be positive")


# ------------------------------------------------------------------------------------ events
@dataclass(frozen=True, slots=True)
class EngineBlockStored:
    """Blocks entered the engine's cache, each chained to the previous (the first to parent)."""

    block_hashes: tuple[EngineHash, ...]
    parent_hash: EngineHash | None
    token_ids: tuple[int, ...]  # all the blocks' tokens, block_size each
    block_size: int
    medium: str | None = None  # None or "GPU": device memory; others are offload tiers
    group_idx: int = 0  # KV-cache group of a hybrid model
    lora_id: int | None = None
    lora_name: str | None = None
    keyed: tuple[bool, ...] = ()  # per block: carries extra keys (images, salt); () = none
    spec_kind: str | None = None  # vLLM's kv_cache_spec_kind ("full_attention", ...); None: unsaid
    salt: str | None = None  # the cache_salt of a root block (keyed only by it), see salt_of

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.group_idx < 0:
            raise ValueError("block_size must be positive and group_idx non-negative")
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError("token_ids must hold block_size tokens per block hash")
        if self.keyed and len(self.keyed) != len(self.block_hashes):
            raise ValueError("keyed must be empty or hold one flag per block")


@dataclass(frozen=True, slots=True)
class EngineBlockRemoved:
    """Blocks left the engine's cache."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class EngineAllCleared:
    """The engine dropped its whole cache (of this medium)."""

    medium: str | None = None


@dataclass(frozen=True, slots=True)
class UnknownEngineEvent:
    """An event type this version does not know; counted and skipped."""

    type_name: str


KvEvent = EngineBlockStored | EngineBlockRemoved | EngineAllCleared | UnknownEngineEvent


@dataclass(frozen=True, slots=True)
class KvBatch:
    """One published batch: the events of one engine step, in order."""

    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None


def is_device_medium(medium: str | None) -> bool:
    """True for blocks in accelerator memory (medium absent or "GPU"; vLLM's CPU build says
    "GPU" too for its main KV pool — "CPU" there means the offload tier)."""
    return medium is None or medium.upper() == "GPU"


# vLLM's KVCacheSpecKind values whose blocks hold the full prefix's KV (a prefix hit on them
# alone is a real hit); sliding-window, chunked-local, mamba, encoder and cross-attention
# groups do not, and are not indexed.
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


def is_full_attention(spec_kind: str | None) -> bool:
    """True for a full-attention KV group (or an engine that does not say: SGLang, older vLLM)."""
    return spec_kind is None or spec_kind in FULL_ATTENTION_KINDS


# ----------------------------------------------------------------------------------- payload
_DEFAULT_LIMITS = KvLimits()
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
_RANK_KEYS = ("data_parallel_rank", "attn_dp_rank", "dp_rank")


def decode_batch(payload: bytes, limits: KvLimits | None = None) -> KvBatch:
    """Parse one event batch; raises :class:`RemoteProtocolError` (only) if it is not valid."""
    lim = limits or _DEFAULT_LIMITS
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise RemoteProtocolError("event payload is not bytes", "frames")
    if len(payload) > lim.max_payload_bytes:
        raise RemoteProtocolError(f"event payload of {len(payload)} bytes", "size")
    raw = _unpack_batch(bytes(payload), lim)
    try:
        return _BatchParser(lim).batch(raw)
    except RemoteProtocolError:
        raise
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:
        raise RemoteProtocolError(f"malformed event batch: {exc}", "malformed") from None


def _unpack_batch(data: bytes, lim: KvLimits) -> Any:
    return unpack_checked(
        data,
        max_str=lim.max_str_len,
        max_bin=max(lim.max_hash_bytes, lim.max_str_len),
        # an element takes at least one byte: never let a header reserve more than that
        max_array=min(max(lim.max_events, lim.max_tokens, lim.max_hashes), len(data)),
        max_map=lim.max_map_len,
        what="event payload",
    )


def _bad(what: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"malformed event batch: {what}", "malformed")


def _int(v: Any, what: str, minimum: int = 0) -> int:
    if type(v) is not int or v < minimum:
        raise _bad(f"{what} must be an integer >= {minimum}")
    return v


def _opt_int(v: Any, what: str) -> int | None:
    return None if v is None else _int(v, what, minimum=-(2**63))


def _opt_str(v: Any, what: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise _bad(f"{what} must be a string")
    return v


def _list(v: Any, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise _bad(f"{what} must be a list")
    return v


def _keyed(v: Any, n_blocks: int) -> tuple[bool, ...]:
    """Per-block flags from ``extra_keys`` (None, or one entry per block, None/empty = none)."""
    if v is None or v == []:
        return ()
    if isinstance(v, list) and len(v) == n_blocks:
        flags = tuple(bool(item) for item in v)
        return flags if any(flags) else ()
    return (True,) * n_blocks  # a shape we do not know: every block is keyed (never indexed)


def without_lora(v: Any, lora: str | None) -> Any:
    """``extra_keys`` with a LoRA request's adapter name taken off the front of each block's
    keys (vLLM puts it first in every block: ``_gen_lora_extra_hash_keys``); unchanged when
    the shape is not that."""
    if lora is None or not isinstance(v, list):
        return v
    if not all(isinstance(e, list) and e[:1] == [lora] for e in v):
        return v
    return [e[1:] or None for e in v]


def salt_of(v: Any, n_blocks: int) -> str | None:
    """The ``cache_salt`` of a run starting at token 0 whose only extra key is that salt: vLLM
    puts ``[request.cache_salt]`` into the first block's extra keys (vllm/v1/core/
    kv_cache_utils.py, ``generate_block_hash_extra_keys``) and publishes them per block
    (vllm/distributed/kv_events.py, ``BlockStored.extra_keys``); None for any other shape."""
    if not isinstance(v, list) or len(v) != n_blocks or not v:
        return None
    first = v[0]
    if not (isinstance(first, list) and len(first) == 1 and isinstance(first[0], str)):
        return None
    if not 0 < len(first[0]) <= 256 or any(item for item in v[1:]):
        return None
    return first[0]


def _salt_and_keys(extra: Any, field: Any, root: bool, n_blocks: int
                   ) -> tuple[str | None, tuple[bool, ...]]:
    """A run's namespace and per-block keyed flags. A root run's salt is vLLM's, in
    ``extra_keys`` (:func:`salt_of`), or SGLang's ``cache_salt`` field (0.5.23,
    ``srt/disaggregation/kv_events.py`` ``BlockStored``: on every page a salted request
    stores; children follow their root here). A root whose field is not a salt we can use
    (malformed, or disagreeing with ``extra_keys``) is keyed, never indexed: the engine keeps it
    apart, so it must not match as the shared namespace."""
    if not root:
        return None, _keyed(extra, n_blocks)
    salt = salt_of(extra, n_blocks)
    if field is None:
        return salt, (() if salt is not None else _keyed(extra, n_blocks))
    if isinstance(field, str) and 0 < len(field) <= 256 and salt in (None, field):
        return field, ()
    return None, (True,) * n_blocks


class _BatchParser:
    """Checks one decoded batch tree; holds its token and hash budgets."""

    def __init__(self, limits: KvLimits) -> None:
        self.lim = limits
        self.tokens_left = limits.max_tokens
        self.hashes_left = limits.max_hashes

    def batch(self, raw: Any) -> KvBatch:
        if isinstance(raw, dict):
            ts, events = raw.get("ts"), raw.get("events")
            rank = next((raw[k] for k in _RANK_KEYS if raw.get(k) is not None), None)
        elif isinstance(raw, list) and len(raw) >= 2:
            ts, events, rank = raw[0], raw[1], (raw[2] if len(raw) > 2 else None)
        else:
            raise _bad("a batch is [ts, events, rank] or a map")
        items = _list(events, "events")
        if len(items) > self.lim.max_events:
            raise RemoteProtocolError(f"{len(items)} events in one batch", "limit")
        return KvBatch(_ts(ts), tuple(self.event(e) for e in items), _rank(rank))

    def event(self, raw: Any) -> KvEvent:
        if isinstance(raw, list) and raw and isinstance(raw[0], str):
            names = _ARRAY_FIELDS.get(raw[0])
            if names is None:
                return UnknownEngineEvent(raw[0][:64])
            return self.typed(raw[0], dict(zip(names, raw[1:], strict=False)))
        if isinstance(raw, dict):
            kind = raw.get("type")
            if not isinstance(kind, str):
                raise _bad("event map without a string 'type'")
            return self.typed(kind, raw)
        raise _bad("an event is a tagged array or a map with 'type'")

    def typed(self, kind: str, f: Mapping[str, Any]) -> KvEvent:
        if kind == "BlockStored":
            return self.stored(f)
        if kind == "BlockRemoved":
            return EngineBlockRemoved(
                self.hashes(f.get("block_hashes")),
                _opt_str(f.get("medium"), "medium"),
                _group(f.get("group_idx")),
            )
        if kind == "AllBlocksCleared":
            return EngineAllCleared(_opt_str(f.get("medium"), "medium"))
        return UnknownEngineEvent(kind[:64])

    def stored(self, f: Mapping[str, Any]) -> EngineBlockStored:
        hashes = self.hashes(f.get("block_hashes"))
        tokens = self.tokens(f.get("token_ids"))
        size = _block_size(f.get("block_size"), len(hashes), len(tokens))
        parent = f.get("parent_block_hash")
        extra = f.get("extra_keys")
        lora = _opt_str(f.get("lora_name"), "lora_name")
        extra = without_lora(extra, lora)
        salt, keyed = _salt_and_keys(extra, f.get("cache_salt"), parent is None, len(hashes))
        return EngineBlockStored(
            block_hashes=hashes,
            parent_hash=None if parent is None else self.hash(parent),
            token_ids=tokens,
            block_size=size,
            medium=_opt_str(f.get("medium"), "medium"),
            group_idx=_group(f.get("group_idx")),
            lora_id=_opt_int(f.get("lora_id"), "lora_id"),
            lora_name=lora,
            keyed=keyed,
            spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
            salt=salt,
        )

    def hashes(self, v: Any) -> tuple[EngineHash, ...]:
        items = _list(v, "block_hashes")
        self.hashes_left -= len(items)
        if self.hashes_left < 0:
            raise RemoteProtocolError("too many block hashes in one batch", "limit")
        return tuple(self.hash(h) for h in items)

    def hash(self, v: Any) -> EngineHash:
        if type(v) is int and _I64_MIN <= v <= _U64:
            return v & _U64
        if isinstance(v, bytes) and 0 < len(v) <= self.lim.max_hash_bytes:
            return v
        raise _bad("a block hash is a 64-bit integer or a short bytes value")

    def tokens(self, v: Any) -> tuple[int, ...]:
        items = _list(v, "token_ids")
        self.tokens_left -= len(items)
        if self.tokens_left < 0:
            raise RemoteProtocolError("too many token ids in one batch", "limit")
        if not all(type(t) is int for t in items):
            raise _bad("token ids must be integers")
        if items and (min(items) < 0 or max(items) > _TOKEN_MAX):
            raise _bad("token ids must be in [0, 2**32)")
        return tuple(items)


def _ts(v: Any) -> float:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise _bad("ts must be a finite number")
    return float(v)


def _rank(v: Any) -> int | None:
    return None if v is None else _int(v, "dp rank")


def _group(v: Any) -> int:
    return 0 if v is None else _int(v, "group_idx")


def _block_size(v: Any, n_hashes: int, n_tokens: int) -> int:
    """The event's block size; absent, it is inferred when the tokens split evenly."""
    if v is None:
        if n_hashes == 0 or n_tokens % n_hashes or n_tokens == 0:
            raise _bad("block_size missing and not inferable")
        return n_tokens // n_hashes
    size = _int(v, "block_size", minimum=1)
    if n_tokens != n_hashes * size:
        raise _bad(f"{n_tokens} token ids for {n_hashes} blocks of {size}")
    return size
