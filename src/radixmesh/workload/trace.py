"""JSONL traces: one request per line, so any workload can be exported and replayed.

Line schema: ``{"id": str, "prompt": str | "messages": [{"role", "content"}], "max_tokens":
int, "group"?: str, "entry"?: int (node index), "t"?: float (arrival seconds), "after"?: str
(the id of an earlier line whose answer this one waits for)}``. Unknown keys
are ignored (forward compatible); a malformed line raises ``TraceError`` naming the line.
``id`` may be omitted on load (it becomes the line number).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from radixmesh.workload.request import Message, Request


class TraceError(ValueError):
    pass


def to_json(r: Request) -> dict[str, Any]:
    out: dict[str, Any] = {"id": r.id}
    if r.prompt is not None:
        out["prompt"] = r.prompt
    else:
        assert r.messages is not None
        out["messages"] = [{"role": m.role, "content": m.content} for m in r.messages]
    out["max_tokens"] = r.max_tokens
    for key in ("group", "entry", "t", "after"):
        value = getattr(r, key)
        if value is not None:
            out[key] = value
    return out


def _typed(obj: dict[str, Any], key: str, types: tuple[type, ...]) -> Any:
    value = obj.get(key)
    if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
        raise TraceError(f"{key!r} must be {' or '.join(t.__name__ for t in types)}")
    return value


def _messages(raw: Any) -> tuple[Message, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise TraceError("'messages' must be a list")
    out = []
    for m in raw:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise TraceError("each message needs string 'role' and 'content'")
        out.append(Message(m["role"], m["content"]))
    return tuple(out)


def from_json(obj: Any, default_id: str) -> Request:
    if not isinstance(obj, dict):
        raise TraceError("a trace line must be a JSON object")
    t = _typed(obj, "t", (int, float))
    after = _typed(obj, "after", (str, int))  # a request id, as "id" may be
    try:
        return Request(
            id=str(_typed(obj, "id", (str, int)) or default_id),
            prompt=_typed(obj, "prompt", (str,)),
            messages=_messages(obj.get("messages")),
            max_tokens=_typed(obj, "max_tokens", (int,)) or 1,
            group=_typed(obj, "group", (str,)),
            entry=_typed(obj, "entry", (int,)),
            t=None if t is None else float(t),
            after=None if after is None else str(after),
        )
    except ValueError as exc:
        raise TraceError(str(exc)) from exc


def write(requests: Iterable[Request], fh: IO[str]) -> int:
    n = 0
    for r in requests:
        fh.write(json.dumps(to_json(r), ensure_ascii=False) + "\n")
        n += 1
    return n


def read(fh: Iterable[str], name: str = "<trace>") -> list[Request]:
    out: list[Request] = []
    for lineno, line in enumerate(fh, start=1):
        if not line.strip():
            continue
        try:
            out.append(from_json(json.loads(line), default_id=str(lineno)))
        except (json.JSONDecodeError, TraceError) as exc:
            raise TraceError(f"{name}:{lineno}: {exc}") from exc
    ids = [r.id for r in out]
    if len(set(ids)) != len(ids):
        raise TraceError(f"{name}: request ids are not unique")
    return out


def save(requests: Iterable[Request], path: str | Path) -> int:
    with Path(path).open("w", encoding="utf-8") as fh:
        return write(requests, fh)


def load(path: str | Path) -> list[Request]:
    with Path(path).open(encoding="utf-8") as fh:
        return read(fh, str(path))
