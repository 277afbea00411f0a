"""One record per request per run: what the client saw plus what the node said in headers.

Written as one JSON line each to ``requests.jsonl`` while a sweep runs (so Ctrl-C keeps what
finished). Field meanings:

``seq``       position in the run's request order (0-based)
``entry``     index of the node (or the router) the client sent to; ``entry_node`` its id
``served_by`` node id from ``x-radixmesh-served-by``
``route``     ``local`` | ``forwarded`` | ``fallback`` (``x-radixmesh-route``)
``expected_cached_tokens``  the router's estimate at decision time; ``cached_tokens`` what the
              serving engine actually reused; ``prompt_tokens`` from ``usage``
``placement`` the router's tag of its choice (``x-radixmesh-placement``, ``core.router.Tag``:
              hit, first, replica, second_copy, unplaced, local_copy); None where the policy
              places nothing, and in folders written before the header existed
``request``   the entry node's number of the request (``x-radixmesh-request``): its routing
              decisions in the run's ``decisions/<run>.jsonl`` carry it (scripts/why.py)
``t_send``/``t_done``  seconds since the run started; ``latency_s`` = client-side wall time
              (includes the emulated network delay of a forward)
``ttft_s``    time to first token, client side (the stream's first generated text); None
              where the run did not stream (older folders) or nothing was generated
``tpot_s``    time per output token after the first, client side; None under 2 tokens
``server_timing``  any ``server-timing`` parts the node reported (name -> seconds)
``error``     ``None`` or a short description (HTTP status + message, or the exception)
``finish_reason``  ``stop`` | ``length`` as the API said (what the engine cached depends on it)
``warmup``    sent during the run's warm-up (``bench`` / ``sim --exclude-warmup``,
              :func:`in_warmup`): kept here, left out of the run's figures
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Record:
    run: str
    policy: str
    seq: int
    id: str
    group: str | None
    entry: int
    entry_node: str
    t_send: float
    t_done: float = 0.0
    latency_s: float = 0.0
    served_by: str | None = None
    route: str | None = None
    expected_cached_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    server_timing: dict[str, float] = field(default_factory=dict)
    status: int | None = None
    error: str | None = None
    output: str | None = None
    finish_reason: str | None = None
    placement: str | None = None
    request: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    warmup: bool = False

    def to_json(self) -> dict[str, Any]:
        # Shallow, unlike dataclasses.asdict (which deep-copied every record: seconds per
        # 100k records in the simulator); the only nested value is copied here.
        obj = {name: getattr(self, name) for name in self.__dataclass_fields__}
        obj["server_timing"] = dict(self.server_timing)
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Record:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in obj.items() if k in names})

    @property
    def ok(self) -> bool:
        return self.error is None


def in_warmup(seq: int, t_send: float, requests: int, seconds: float) -> bool:
    """Whether a request (its position ``seq``, its unscaled send time ``t_send``) is part of
    a warm-up of the first ``requests`` requests or ``seconds`` seconds (``--exclude-warmup``)."""
    return seq < requests or t_send < seconds
