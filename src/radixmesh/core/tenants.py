"""Tenants and cache namespaces: who a client request belongs to, and which cache it may use.

Theory of operation
-------------------
A client request's *cache namespace* decides which prefixes it can match (``core/blocks.py``:
the namespace seeds the block-hash chain). Two sources, combined::

    API key ──(--api-keys FILE: key -> tenant)──▶ tenant  ─┐
    request field ``cache_salt`` (vLLM's) ────────────────▶ salt  ─┴─▶ namespace_id(tenant, salt)

* neither: ``None`` — today's shared cache (the single ``--api-key``, or an open API);
* a tenant, a salt, or both: ``namespace_id`` = a keyed hash (HMAC-SHA256 under a key derived
  from the cluster key; a fixed key without one) of the length-prefixed pair, 32 hex digits.
  A salt is scoped to its tenant: tenant B naming tenant A's salt gets a namespace of its
  own, never A's. Keyed, because the id seeds hashes that travel in gossip: without the
  cluster key an observer cannot test guessed tenant names against them.

API keys (``ApiKeys``): the single operator key (``--api-key`` / ``RADIXMESH_API_KEY``) maps
to no tenant (shared cache, and it alone opens ``/mesh``, ``/metrics`` and ``/admin``); each
key of the ``--api-keys`` file maps to its tenant (``/v1/*`` only). When any key is set, a
request without a known key is a 401. Keys are compared in constant time (one
``hmac.compare_digest`` per known key: the time depends on the number of keys, not on which
matched).

File format (``parse_api_keys``): one ``KEY TENANT`` pair per line, blank lines and ``#``
comments ignored; a key at least 16 characters, a tenant 1-128 of ``[A-Za-z0-9._:@-]``; a key
listed twice is an error naming the line.

Request fields (``check_cache_field``): ``cache_salt`` and OpenAI's ``prompt_cache_key`` are
strings of at most 256 characters; anything else is a ``ValueError`` naming the field (a 400).
Pure: no I/O; the keys come from the caller.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass

MAX_CACHE_FIELD_CHARS = 256  # cache_salt, prompt_cache_key, x-session-id
MIN_API_KEY_CHARS = 16
_TENANT_RE = re.compile(r"[A-Za-z0-9._:@\-]{1,128}")
_NAMESPACE_LABEL = b"radixmesh cache namespace v1"
_UNKEYED = b"radixmesh: no cluster key"


def check_cache_field(name: str, value: object) -> str | None:
    """``value`` of request field ``name`` (``cache_salt``, ``prompt_cache_key``): None or
    a string of at most 256 characters, else ValueError naming the field. "" reads as None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if len(value) > MAX_CACHE_FIELD_CHARS:
        raise ValueError(f"{name} must be at most {MAX_CACHE_FIELD_CHARS} characters, "
                         f"got {len(value)}")
    return value or None


class Namespacer:
    """Keyed namespace ids (see the module docstring); ``key``: the cluster key, if any."""

    def __init__(self, key: bytes | None) -> None:
        self._key = hmac.new(key or _UNKEYED, _NAMESPACE_LABEL, hashlib.sha256).digest()

    def namespace_id(self, tenant: str | None, salt: str | None,
                     adapter: str | None = None) -> str | None:
        """The cache namespace of a request (None: the shared cache); ``adapter``: the content
        digest of its LoRA adapter (core/adapters.py), whose KV is never the base model's."""
        if adapter is not None:
            return self.keyed(b"ns+adapter", tenant, salt, adapter)
        if tenant is None and salt is None:
            return None
        return self.keyed(b"ns", tenant, salt)

    def session_id(self, tenant: str | None, key: str) -> int:
        """The 64-bit session id of ``prompt_cache_key`` ``key`` for ``tenant``."""
        return int(self.keyed(b"session", tenant, key)[:16], 16)

    def keyed(self, kind: bytes, *parts: str | None) -> str:
        """32 hex digits naming ``parts`` (None distinct from ""), under this mesh's key."""
        mac = hmac.new(self._key, _field(kind), hashlib.sha256)
        for part in parts:
            mac.update(b"\x00" if part is None else b"\x01" + _field(part.encode("utf-8")))
        return mac.hexdigest()[:32]


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a client request: ``operator`` (the single key, or no key configured) or a
    tenant of the ``--api-keys`` file."""

    tenant: str | None
    operator: bool


class ApiKeys:
    """The client API's keys: the operator key (shared cache) and tenant keys."""

    def __init__(self, operator_key: str = "", tenant_keys: Mapping[str, str] | None = None
                 ) -> None:
        op = operator_key.strip()
        self._operator = op.encode("utf-8") if op else None
        self._tenants = [(k.encode("utf-8"), t) for k, t in (tenant_keys or {}).items()]
        self.rejected = 0

    @property
    def enabled(self) -> bool:
        return self._operator is not None or bool(self._tenants)

    @property
    def tenants(self) -> int:
        return len({t for _, t in self._tenants})

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller of a request with this ``Authorization`` header; None: refused (401)."""
        if not self.enabled:
            return Caller(None, True)
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode("utf-8")
        found: Caller | None = None
        if scheme.lower() == "bearer":
            if self._operator is not None and hmac.compare_digest(given, self._operator):
                found = Caller(None, True)
            for key, tenant in self._tenants:  # every key compared: no early exit
                if hmac.compare_digest(given, key):
                    found = Caller(tenant, False)
        if found is None:
            self.rejected += 1
        return found


def parse_api_keys(text: str, source: str = "api-keys file") -> dict[str, str]:
    """``KEY TENANT`` lines (see the module docstring) as {key: tenant}; ValueError naming
    the line otherwise."""
    keys: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"{source} line {number}"
        if len(parts) != 2:
            raise ValueError(f"{where}: expected 'KEY TENANT', got {len(parts)} fields")
        key, tenant = parts
        if len(key) < MIN_API_KEY_CHARS:
            raise ValueError(f"{where}: a key must be at least {MIN_API_KEY_CHARS} characters")
        if not _TENANT_RE.fullmatch(tenant):
            raise ValueError(f"{where}: a tenant is 1-128 of A-Z a-z 0-9 . _ : @ -")
        if key in keys:
            raise ValueError(f"{where}: this key is listed twice")
        keys[key] = tenant
    return keys
