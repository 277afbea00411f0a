"""Checked reading of remote bytes: bounded msgpack decoding and hand-checked fields.

Theory of operation
-------------------
Every decoder of bytes from outside the process (peer gossip and forwards: :mod:`codec`,
:mod:`forward_codec`; engines' KV events: :mod:`kv_events`) reads them through here.
:func:`unpack_checked` lets msgpack's own limits bound strings, binaries, arrays and maps before
anything is allocated; the readers (``check_int``, ``check_float``, ``check_bool``,
``check_text``, ``check_array``) then check one field each by hand: bools are not ints, floats
are finite, strings and arrays have the lengths they must. Anything wrong raises
:class:`RemoteProtocolError` — and only that (:func:`checked` turns what else a malformed tree
can raise into it), so a shell counts the message and drops it, never crashes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

INT_MAX = 2**63 - 1
U32_MAX = 2**32 - 1  # counts a node really has (queues, requests in flight) fit in this
_T = TypeVar("_T")


class RemoteProtocolError(Exception):
    """A peer sent bytes that are not a valid message (the peer's fault, never ours)."""

    def __init__(self, message: str, reason: str = "decode") -> None:
        super().__init__(message)
        self.reason = reason  # metric suffix: messages_rejected_<reason>


def unpack_checked(
    data: bytes, *, max_str: int, max_bin: int, max_array: int, max_map: int = 0,
    what: str = "message",
) -> Any:
    """msgpack-decode ``data`` within these lengths (str in bytes); maps only up to ``max_map``
    entries (none by default), no extensions. Shared by every decoder of remote bytes."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=max_str,
            max_bin_len=max_bin,
            max_array_len=max_array,
            max_map_len=max_map,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types on hostile input; all are remote
        raise RemoteProtocolError(f"undecodable {what}: {type(exc).__name__}") from None


def checked(parse: Callable[[Any], _T], raw: Any) -> _T:
    """``parse(raw)``, any error a malformed tree can cause turned into RemoteProtocolError."""
    try:
        return parse(raw)
    except RemoteProtocolError:
        raise
    except (ValueError, TypeError, IndexError, OverflowError) as exc:
        raise RemoteProtocolError(f"malformed message: {exc}") from None


def check_array(v: Any, n: int, what: str) -> list[Any]:
    if not isinstance(v, list) or len(v) != n:
        raise RemoteProtocolError(f"{what}: expected an array of {n} fields")
    return v


def check_int(v: Any, what: str, maximum: int = INT_MAX, minimum: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not minimum <= v <= maximum:
        raise RemoteProtocolError(f"{what}: expected an integer in [{minimum}, {maximum}]")
    return v


def check_float(v: Any, what: str, minimum: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise RemoteProtocolError(f"{what}: expected a number")
    x = float(v)
    if not math.isfinite(x) or (minimum is not None and x < minimum):
        raise RemoteProtocolError(f"{what}: not a finite number in range")
    return x


def check_bool(v: Any, what: str) -> bool:
    if not isinstance(v, bool):
        raise RemoteProtocolError(f"{what}: expected a boolean")
    return v


def check_text(v: Any, limit: int, what: str, minimum: int = 1) -> str:
    if not isinstance(v, str) or not minimum <= len(v) <= limit:
        raise RemoteProtocolError(f"{what}: expected a string of {minimum}..{limit} characters")
    return v
