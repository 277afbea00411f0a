"""Per-tenant admission quotas: each tenant may hold at most a share of this node's queue.

Theory of operation
-------------------
Bounded admission (core/admission.py) caps what the *node* queues: ``max_queue_requests``,
``max_queue_wait_s`` (as requests at the measured mean service time) and the token bound
(``token_cap``). Without quotas one tenant (``--api-keys``: core/tenants.py) that floods a
node fills those bounds and every other tenant's requests get the 429. With
``tenant_queue_share = s`` (off by default: today's behaviour) each tenant may hold at most
``s`` of each bound among the requests *admitted to run on this node* (queued or running in
its engine: its own clients' requests run here and peers' forwards accepted here)::

    requests held by T + 1        <= max(1, floor(s x request bound))
    tokens held by T + this one's <= max(1, floor(s x token bound))

A tenant holding nothing is always admitted (as an idle node is: a request larger than the
share must run somewhere). Requests without a tenant (the operator's key, an open API) have
no quota: they share whatever room the tenants leave, under the node's own bounds as today.

The verdict for tenant T reads T's own counters and the node's bounds only, so a tenant under
its share is never refused *by its quota* for another tenant's load. The node's own bounds
still apply to everyone: with share ``s``, ``ceil(1/s)`` tenants flooding at once can fill
the node, and then every request meets today's overload 429 (or goes to a peer with room).

Where it is checked: where a request is admitted to run. An entry node whose tenant is over
its share here treats itself as full for that request (the lifecycle tries peers, then
answers 429 with the node's retry-after); a node receiving a peer's forward refuses it as
busy when the tenant is over its share there. Forwards carry the tenant as a keyed hash
(``Namespacer.keyed``), the quota key on every node, never the name in clear.

One API request is one admission: its samples (``n``) and prompts are checked together, as
``k`` requests of their tokens in all, at its entry node, and those after the first ride on
that verdict (a prompt's other samples must run where its first ran: checked one by one, the
cap's worth would always leave the next one "full" there). ``k`` above the tenant's request
cap can never fit (:meth:`TenantQuotas.never_fits`): the client gets a 400 saying so, not a
429 that retrying never cures. A peer still checks each forward it receives by itself.
Counted (``admission_full_quota``) only where the quota decides: a client's 429 (no peer took
it either) or a peer's forward refused as busy.

Pure: the shell calls :meth:`TenantQuotas.admit` when a request joins its engine's queue and
:meth:`TenantQuotas.release` with the ticket when it leaves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Bounds:
    """The node's admission bounds in force (None: that bound is off)."""

    requests: int | None
    tokens: int | None


def admission_bounds(max_queue_requests: int | None, max_queue_wait_s: float,
                     mean_service_s: float, token_cap: int | None,
                     streams: float = 1.0) -> Bounds:
    """The node's bounds as counts: the request bound is the tighter of
    ``max_queue_requests`` and the requests that fill ``max_queue_wait_s`` at the measured
    mean service time, ``streams`` of them at once (``OwnLoad.streams``, as
    ``admission.admission`` reckons the wait; none measured yet: no wait bound)."""
    by_wait = (max(int(max_queue_wait_s * max(streams, 1.0) / mean_service_s), 1)
               if mean_service_s > 0 else None)
    counts = [c for c in (max_queue_requests, by_wait) if c is not None]
    return Bounds(min(counts) if counts else None, token_cap)


def check_share(share: float | None) -> float | None:
    """``tenant_queue_share``: None (off) or a fraction in (0, 1]; ValueError otherwise."""
    if share is not None and not 0 < share <= 1:
        raise ValueError(f"tenant_queue_share must be in (0, 1] or off, got {share!r}")
    return share


def tenant_caps(share: float, bounds: Bounds) -> Bounds:
    """One tenant's caps: ``share`` of each bound, at least 1 (None: that bound is off)."""
    def part(bound: int | None) -> int | None:
        return None if bound is None else max(1, math.floor(share * bound))
    return Bounds(part(bounds.requests), part(bounds.tokens))


@dataclass(slots=True)
class TenantHeld:
    """What one tenant holds on this node: requests and their tokens (prompt + max_tokens)."""

    requests: int = 0
    tokens: int = 0


@dataclass(slots=True)
class TenantQuotas:
    """Per-tenant counters of the requests admitted to run here, and the quota verdict."""

    share: float | None = None  # None: quotas off
    _held: dict[str, TenantHeld] = field(default_factory=dict)
    _tickets: dict[int, tuple[str, int]] = field(default_factory=dict)
    _next: int = 0

    def __post_init__(self) -> None:
        check_share(self.share)

    def held(self, tenant: str) -> TenantHeld:
        """What ``tenant`` holds here now (a copy)."""
        h = self._held.get(tenant)
        return TenantHeld() if h is None else TenantHeld(h.requests, h.tokens)

    def over(self, tenant: str | None, tokens: int, bounds: Bounds, requests: int = 1) -> bool:
        """Whether ``requests`` requests of ``tokens`` in all from ``tenant`` (one API
        request's samples and prompts, admitted together) would take it over its share of
        ``bounds`` (never for no tenant, with quotas off, or for a tenant holding nothing
        when they fit its request cap: :meth:`never_fits`)."""
        if tenant is None or self.share is None:
            return False
        caps = tenant_caps(self.share, bounds)
        held = self._held.get(tenant, TenantHeld())
        if caps.requests is not None and held.requests + requests > caps.requests:
            return True
        return (caps.tokens is not None and held.requests > 0
                and held.tokens + max(tokens, 0) > caps.tokens)

    def never_fits(self, tenant: str | None, requests: int, bounds: Bounds) -> int | None:
        """The tenant's request cap when ``requests`` requests admitted together exceed it
        (they can never run here at once: the client must send fewer), else None."""
        if tenant is None or self.share is None:
            return None
        cap = tenant_caps(self.share, bounds).requests
        return cap if cap is not None and requests > cap else None

    def admit(self, tenant: str | None, tokens: int) -> int | None:
        """Count a request of ``tenant`` that joined this node's queue; its ticket for
        :meth:`release` (None: no tenant, nothing counted)."""
        if tenant is None:
            return None
        held = self._held.setdefault(tenant, TenantHeld())
        held.requests += 1
        held.tokens += max(tokens, 0)
        self._next += 1
        self._tickets[self._next] = (tenant, max(tokens, 0))
        return self._next

    def release(self, ticket: int | None) -> None:
        """The request of ``ticket`` left the queue (idempotent; None: nothing to do)."""
        entry = None if ticket is None else self._tickets.pop(ticket, None)
        if entry is None:
            return
        tenant, tokens = entry
        held = self._held[tenant]
        held.requests -= 1
        held.tokens -= tokens
        if held.requests == 0:
            del self._held[tenant]
