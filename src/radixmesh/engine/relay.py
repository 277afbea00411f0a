"""The token path from an engine thread to the event loop, shared by the engines that run a
model on a thread of their own (``ThreadedEngine``, ``BatchedEngine``).

Theory of operation
-------------------
A :class:`Relay` is one request's path: the engine thread calls ``from_engine(token)`` (and the
logprob hooks), which schedules the request's callback on the loop with
``call_soon_threadsafe`` (FIFO, so in order). Once the awaiting task is cancelled the loop sets
``stopped``; the next ``from_engine`` raises :class:`RequestStopped` on the engine thread, which
ends the request there. A callback that raises on the loop stops the request too (``error``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from radixmesh.engine.base import (
    LogprobCallback,
    PromptLogprobCallback,
    TokenCallback,
    TokenLogprob,
)

CLOSE_WAIT_S = 5.0  # aclose(): how long to wait for the engine thread


class RequestStopped(Exception):
    """Raised from ``on_token`` on the engine thread to stop a request (its caller cancelled)."""


class Relay:
    """One request's token path from the engine thread to the loop; cut once ``stopped``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_token: TokenCallback | None,
                 on_logprob: LogprobCallback | None = None,
                 on_prompt: PromptLogprobCallback | None = None) -> None:
        self._loop, self._on_token, self._on_logprob = loop, on_token, on_logprob
        self._on_prompt = on_prompt
        self.stopped = False  # written on the loop, read on the engine thread
        self.error: Exception | None = None  # what on_token raised (it stopped the request)

    def from_engine(self, tok: int) -> None:  # on the engine thread
        if self.stopped:
            raise RequestStopped("the request was stopped")
        if self._on_token is not None:
            self._loop.call_soon_threadsafe(self._deliver, self._on_token, tok)

    def logprob_from_engine(self, entry: TokenLogprob) -> None:  # on the engine thread
        if self._on_logprob is not None and not self.stopped:
            self._loop.call_soon_threadsafe(self._deliver, self._on_logprob, entry)

    def prompt_from_engine(self, entries: tuple[TokenLogprob | None, ...]) -> None:
        if self._on_prompt is not None and not self.stopped:  # on the engine thread
            self._loop.call_soon_threadsafe(self._deliver, self._on_prompt, entries)

    def _deliver(self, callback: Callable[[Any], None], value: object) -> None:  # on the loop
        """Hand ``value`` to the request's ``callback``; an exception from it stops the
        request (kept in ``error``)."""
        if self.stopped:
            return
        try:
            callback(value)
        except Exception as exc:
            self.error, self.stopped = exc, True
