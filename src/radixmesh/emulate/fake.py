"""The test fake of vLLM: the emulated engine with a zero-time profile, dressed for tests.

Theory of operation
-------------------
There is one fake vLLM in the project, :class:`~.server.EmulatedEngine`; this module only
dresses it for in-process tests (as a process it is ``radixmesh emulate``). :class:`FakeEngine`
takes a token budget instead of a profile (``cache_tokens`` / ``block_size`` become the KV pool
and the context length), runs at time scale 0 (steps take no time unless
``faults.token_delay_s`` says so), accepts any uint32 prompt token id (tests speak several
tokenizers), binds HTTP and both ZMQ sockets on 127.0.0.1 (any free port unless given;
``kv_connect``: the PUB socket connects to a binding subscriber instead) and names what tests
watch: ``active`` / ``peak_active`` requests in flight, ``disconnects``, ``seq``, ``cache``,
``block_prefixes()``. Fault knobs live in ``fake.faults`` (``events.Faults``): skipped /
duplicated batches, replay on/off and framing, ``fail_status``, ``token_delay_s``,
``barrier``, ``stalled`` (SIGSTOP: no step, no ``/health`` answer); ``restart()``,
``clear_all()`` and ``publish_malformed()`` are methods. Output
tokens follow :func:`next_token`.
"""

from __future__ import annotations

import contextlib
from typing import Any

from radixmesh.core.profile import COEFFICIENTS, Profile
from radixmesh.emulate.events import Faults
from radixmesh.emulate.loop import next_token
from radixmesh.emulate.server import EmulatedEngine
from radixmesh.engine.base import Tokenizer

ANY_TOKEN_ID = 2**32  # tests send token ids of any tokenizer: the fake takes every uint32

__all__ = ["FakeEngine", "fake_profile", "next_token", "running"]


def fake_profile(cache_tokens: int, block_size: int, model: str) -> Profile:
    """A profile whose steps take (next to) no time, over a ``cache_tokens`` KV pool."""
    return Profile(
        name="fake", hardware="none (test fake)", model=model,
        source="radixmesh.emulate.fake: a zero-time profile for tests", derived=True,
        step_base_s=1e-9, prefill_token_s=0.0, prefill_attn_s=0.0, decode_seq_s=0.0,
        decode_kv_s=0.0, kv_blocks=cache_tokens // block_size, block_size=block_size,
        context_length=cache_tokens // block_size * block_size, max_running=256,
        step_tokens=8192, citations=dict.fromkeys(COEFFICIENTS, "test fake: no time"))


_FAULT_KNOBS = frozenset(Faults.__dataclass_fields__)


class FakeEngine(EmulatedEngine):
    """See the module docstring. ``await start()``, then ``url`` / ``kv_endpoint`` /
    ``replay_endpoint``; ``await stop()`` ends everything (also a "kill" mid-test)."""

    def __init__(self, *, block_size: int = 16, cache_tokens: int = 512, replay_keep: int = 64,
                 model: str = "fake-model", kv_connect: str | None = None, port: int = 0,
                 kv_port: int = 0, replay_port: int = 0,
                 tokenizer: Tokenizer | None = None, adapters: tuple[str, ...] = ()) -> None:
        self.cache_tokens = cache_tokens
        self.kv_connect = kv_connect
        super().__init__(fake_profile(cache_tokens, block_size, model), model=model,
                         tokenizer=tokenizer, port=port, time_scale=0.0,
                         kv_events=kv_connect or f"tcp://127.0.0.1:{kv_port}",
                         kv_replay=f"tcp://127.0.0.1:{replay_port}",
                         kv_connect=kv_connect is not None, replay_keep=replay_keep,
                         vocab_size=ANY_TOKEN_ID, adapters=adapters)

    def __setattr__(self, name: str, value: Any) -> None:
        # the fault knobs live on ``faults``: setting one here would silently do nothing
        if name in _FAULT_KNOBS:
            raise AttributeError(f"set fake.faults.{name}, not fake.{name}")
        super().__setattr__(name, value)

    @property
    def active(self) -> int:
        """Requests in flight."""
        return self.loop.in_flight

    @property
    def peak_active(self) -> int:
        return self.loop.counters.peak_in_flight


@contextlib.asynccontextmanager
async def running(**kwargs: Any) -> Any:
    """``async with running() as fake:`` a started fake engine, stopped at the end."""
    fake = FakeEngine(**kwargs)
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()
