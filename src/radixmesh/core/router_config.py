"""Routing configuration: the policy a node routes by, and the cost policy's knobs.

Theory of operation
-------------------
:class:`RouterConfig` is plain, validated data (a bad value is a ``ValueError`` naming the
field); the policies it selects are described in ``core/router.py`` and the cost policy's
rules, which most of the knobs tune, in ``core/cost_policy.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from radixmesh.core.units import parse_choice


class Policy(StrEnum):
    NONE = "none"
    PAPER = "paper"
    COST = "cost"
    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    LLMD = "llmd"

    @classmethod
    def parse(cls, text: str) -> Policy:
        return parse_choice(cls, text, "routing policy")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: Policy = Policy.COST
    min_gain_s: float = 0.001  # a forward must be predicted to save at least this (seconds)
    min_gain_frac: float = 0.1  # ... and at least this fraction of the local prediction
    context_scale: float = 4096.0  # see estimators.prefill_work
    load_bound: float | None = 0.5  # cost: no forwards to peers above (1+x) × mean utilization
    load_window_s: float = 10.0  # utilization is measured over about this many seconds
    # cost: a peer over the load bound still takes a forward it is predicted to answer in
    # less than (1 - x) of the time of the best peer within the bound (1: never; 0: whenever
    # it is the fastest)
    load_bound_bypass: float = 0.0
    # ... if it has room: its utilization is below this, or no queue is expected there
    load_bound_floor: float = 0.5
    # cost: a prefix has an owner set on the consistent-hashing ring (every entry node picks
    # the same: no second cold copy), named by the block at this depth (None: off) ...
    placement_depth_blocks: int | None = 16
    # ... and a prefix's holders are preferred while predicted at most this fraction slower
    # than the best choice now (the copy they avoid would cost every later request) ...
    placement_slack: float = 0.75
    # ... and an owner making the first copy while at most this fraction of that copy's
    # work slower (every entry node spends it at once on one stale view: keep it small)
    first_copy_slack: float = 0.1
    # ... and a member busier than (1+x) × the mean utilization is passed over on the ring:
    # no prefix gets it as a new owner (consistent hashing with bounded load; None: off)
    placement_load_bound: float | None = 0.15
    # cost: a hot prefix gets ceil(load / replica_load) owners (load: node-seconds of service
    # per second its requests need, estimated from this node's traffic), at most max_replicas
    replica_load: float = 0.5
    max_replicas: int = 64
    replica_window_s: float = 10.0  # the time constant of a prefix's measured request rate
    # cost: the time constant of the rent a node remembers paying for a prefix's copy
    # elsewhere (see Placement.rent_s)
    rent_window_s: float = 600.0
    # cost: the time constant of a peer's measured queue-wait prediction error (WaitError)
    error_window_s: float = 10.0
    # cost: preferred candidates (owners, holders) within this fraction (and min_gain_s) of the
    # best of them are equal; one is picked at random (self first)
    near_tie: float = 0.1
    # cost: of the peers holding the same part of the prompt on the same engine speed at the
    # same distance, this many at random are ranked (None: all): two choices on old reports
    # instead of every router herding on the least loaded (core/choices.py)
    holder_choices: int | None = 2
    # a peer's reported queue says little after this many of its mean service times (others
    # send to it meanwhile): the deciding node then expects the mesh's mean queue instead
    queue_memory: float = 2.0
    # cost: a node's learnt speed within this factor of the median of the candidates counts
    # as the median (noise on a shared machine must not pull cold traffic to whichever node
    # looks fastest); None = use every estimate as it is
    speed_tolerance: float | None = 1.5

    def stretched(self, scale: float) -> RouterConfig:
        """This configuration with its durations ``scale`` times longer: the windows over
        which rates, loads, rent and errors are measured, and the smallest gain worth a
        forward. For a node whose engine runs ``scale`` times slower than its profile (an
        emulated mesh on a small machine) every rate is ``scale`` times lower, so windows of
        the profile's seconds hold ``scale`` times fewer requests: at 300, a 10 s error
        window held a forward or two and forgot them before the next (``1``: itself)."""
        if scale == 1.0:
            return self
        return replace(self, min_gain_s=self.min_gain_s * scale,
                       load_window_s=self.load_window_s * scale,
                       replica_window_s=self.replica_window_s * scale,
                       rent_window_s=self.rent_window_s * scale,
                       error_window_s=self.error_window_s * scale)

    def __post_init__(self) -> None:
        if self.min_gain_s < 0 or not 0 <= self.min_gain_frac < 1:
            raise ValueError("min_gain_s must be >= 0 and min_gain_frac in [0, 1)")
        if self.load_bound is not None and self.load_bound < 0:
            raise ValueError("load_bound must be >= 0 (or None to disable)")
        if self.placement_depth_blocks is not None and self.placement_depth_blocks < 1:
            raise ValueError("placement_depth_blocks must be >= 1 (or None)")
        if self.placement_slack < 0 or self.first_copy_slack < 0:
            raise ValueError("placement_slack and first_copy_slack must be >= 0")
        if self.placement_load_bound is not None and self.placement_load_bound < 0:
            raise ValueError("placement_load_bound must be >= 0 (or None to disable)")
        if not 0 <= self.load_bound_bypass <= 1 or not 0 <= self.load_bound_floor <= 1:
            raise ValueError("load_bound_bypass and load_bound_floor must be in [0, 1]")
        if self.holder_choices is not None and self.holder_choices < 1:
            raise ValueError("holder_choices must be >= 1 (or None: every holder)")
        if self.load_window_s <= 0:
            raise ValueError("load_window_s must be > 0")
        if self.context_scale <= 0:
            raise ValueError("context_scale must be > 0")
        if self.speed_tolerance is not None and self.speed_tolerance < 1:
            raise ValueError("speed_tolerance must be >= 1 (or None to disable)")
        if self.rent_window_s <= 0 or self.error_window_s <= 0:
            raise ValueError("rent_window_s and error_window_s must be > 0")
        if self.replica_load <= 0 or self.max_replicas < 1 or self.replica_window_s <= 0:
            raise ValueError("replica_load and replica_window_s must be > 0, max_replicas >= 1")
        if self.near_tie < 0 or self.queue_memory <= 0:
            raise ValueError("near_tie must be >= 0 and queue_memory > 0")
