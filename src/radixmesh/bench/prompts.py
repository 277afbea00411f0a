"""The benchmark's view of prompts in the engine's tokens: admission and the hit-rate ceiling.

A request's token ids are what the node will run: a completion prompt encoded, chat messages
through the tokenizer's chat template (the node's own path, ``runtime/app.py``). Admission
(:func:`make_admit`) decides what happens to a prompt that does not leave room for its output
in the engine's context: ``drop`` it (counted per group), ``truncate`` it (its text is cut at
the end, so shared prefixes stay shared) or ``fail`` the run before any cluster starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from radixmesh.bench.spec import RunSpec, engine_context
from radixmesh.workload import Request
from radixmesh.workload.build import TOO_LONG, Admit, Fits
from radixmesh.workload.request import Message

BLOCK_SIZE = 16
CONTEXT_MARGIN = 8  # tokens kept free beyond prompt + output
TOO_LONG_ACTIONS = ("drop", "truncate", "fail")


class PromptTooLong(ValueError):
    """A prompt does not fit and the run was asked to fail rather than drop or truncate."""


def tokenizer_for(spec: RunSpec) -> Any:
    """The nodes' tokenizer: the model directory's, bytes for emulated engines, else the
    built-in preset's (the default ``mini`` is a BPE)."""
    from radixmesh.engine.tokenizers import ByteTokenizer, HFTokenizer

    if spec.model:
        return HFTokenizer(spec.model)
    if spec.node_profiles:
        return ByteTokenizer()
    from radixmesh.engine.factory import preset_tokenizer

    return preset_tokenizer(spec.preset)


def prompt_ids(tokenizer: Any, req: Request) -> list[int]:
    """The token ids the node runs for ``req`` (chat messages through the chat template)."""
    if req.messages is not None:
        msgs = [{"role": m.role, "content": m.content} for m in req.messages]
        return list(tokenizer.apply_chat_template(msgs))
    return list(tokenizer.encode(req.prompt or ""))


def make_fits(spec: RunSpec) -> Fits:
    """Requests whose prompt (in the engine's tokens) leaves room for the output."""
    context = engine_context(spec.preset, spec.model, spec.node_profiles)
    tokenizer = tokenizer_for(spec)
    return lambda r: len(prompt_ids(tokenizer, r)) + r.max_tokens + CONTEXT_MARGIN < context


def make_admit(spec: RunSpec, too_long: str = "drop") -> Admit:
    """Admission for ``too_long`` = ``drop`` | ``truncate`` | ``fail`` (raises PromptTooLong)."""
    if too_long not in TOO_LONG_ACTIONS:
        raise ValueError(f"too-long action must be one of {', '.join(TOO_LONG_ACTIONS)}")
    fits = make_fits(spec)

    def admit(r: Request) -> Request | str:
        if fits(r):
            return r
        if too_long == "fail":
            raise PromptTooLong(f"request {r.id!r} ({r.group}) does not fit the context")
        short = truncated(r, fits) if too_long == "truncate" else None
        return TOO_LONG if short is None else short

    return admit


def truncated(req: Request, fits: Fits) -> Request | None:
    """``req`` with the most leading prompt characters that fit (None if none do)."""
    lo, hi = 1, len(req.text)  # invariant: keep(lo) fits; keep(hi + 1) does not
    if not fits(keep_chars(req, 1)):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(keep_chars(req, mid)) else (lo, mid - 1)
    return keep_chars(req, lo)


def keep_chars(req: Request, n: int) -> Request:
    """The first ``n`` characters of the prompt (for messages: across them, in order)."""
    if req.messages is None:
        return replace(req, prompt=(req.prompt or "")[:n])
    out: list[Message] = []
    for m in req.messages:
        out.append(Message(m.role, m.content[: max(n, 0)]))
        n -= len(m.content)
        if n <= 0:
            break
    return replace(req, messages=tuple(out))


def ideal_hit_rate(requests: Sequence[Request], tokenizer: Any) -> float | None:
    """Cached prompt tokens / prompt tokens if every request found every earlier prompt cached
    (one unbounded cache for the whole cluster; the engine always computes >= 1 token): the
    ceiling no router can beat on this request sequence (generated tokens not counted)."""
    from radixmesh.core.radix import RadixTree

    tree: RadixTree[None] = RadixTree(BLOCK_SIZE, 0)
    cached = total = 0
    for i, r in enumerate(requests):
        ids = prompt_ids(tokenizer, r)
        cached += min(tree.match(ids), len(ids) - 1)
        total += len(ids)
        tree.insert(ids, float(i))
    return cached / total if total else None
