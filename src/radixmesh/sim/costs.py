"""Cost models for the simulator: how long one request takes on one node, as JSON.

Theory of operation
-------------------
The simulated engine does no arithmetic on tensors; it asks a :class:`CostModel` how long a
request takes. The form is the router's own (``core/estimators.py``), so a calibration can be
checked against what the routers learn::

    service = request_overhead
            + prefill_overhead + prefill_rate * work(uncached, cached)     (if uncached > 0)
            + decode_rate * (max_tokens - 1)
    work(u, c) = u * (1 + (c + u / 2) / context_scale)

plus, for a forward, ``forward_overhead_s`` (HTTP client + server work of one hop, both
directions together) on top of the emulated network's one-way delays.

A model comes from ``radixmesh calibrate`` (measured on this machine, ``source`` says how and
when), from a JSON file written by hand, or from a built-in preset:

* ``cpu-tiny`` — the built-in ``tiny`` engine on a 2-core CPU, fitted from the figures in
  GUIDE.md §4 (540-token prefill 44–48 ms, 90 tokens after 450 cached 14–16 ms, decode ~7 ms/token);
* ``gpu-7b`` — an *illustrative* GPU regime (a 7B fp16 model at batch 1 on one datacenter GPU:
  ~10k prefill tokens/s, ~20 ms/token decode). Assumed, not measured here: no GPU was available;
* ``gpu-70b`` — likewise illustrative, a 70B model: ~1.7k prefill tokens/s, ~50 ms/token.

``gpu-7b`` and ``gpu-70b`` are deprecated: step-time profiles (:mod:`radixmesh.core.profile`,
``radixmesh profile list``) replace them with figures that cite their sources. A profile (a
shipped name or a ``.toml`` file) becomes a cost model by :func:`from_profile`, which keeps the
profile (``CostModel.profile``): the simulated engine (``sim/engine.py``) times its batched steps
with ``profile.step_s``; the batch-1 figures derived from it serve the router's priors and the
sweep's capacity estimate. A name that is both a preset and a profile (``cpu-tiny``) means the
preset.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from radixmesh.core.estimators import prefill_work
from radixmesh.core.profile import Profile
from radixmesh.core.profile import resolve as resolve_profile
from radixmesh.core.profile import shipped as shipped_profiles

_DOCUMENTATION_KEYS = {"fit", "measurements"}  # written by calibrate, ignored on load


@dataclass(frozen=True, slots=True)
class CostModel:
    name: str  # short label, e.g. "cpu-tiny" or "calibrated:tiny:cpu"
    prefill_overhead_s: float  # fixed cost of a prefill pass with >= 1 uncached token
    prefill_s_per_token: float  # seconds per work unit (see module doc)
    context_scale: float  # context tokens that double one token's prefill cost
    decode_s_per_token: float  # seconds per generated token after the first
    request_overhead_s: float = 0.0  # engine/handler work per request outside prefill/decode
    forward_overhead_s: float = 0.0  # HTTP work of one forward hop (request + response)
    source: str = "constants"  # where the numbers come from (measurement, date, machine)
    # the step-time profile this model was made from (``from_profile``): the simulated engine
    # times its steps with it; not part of the JSON form, not compared
    profile: Profile | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and value < 0:
                raise ValueError(f"cost model {f.name} must be >= 0, got {value}")
        if self.context_scale <= 0:
            raise ValueError("context_scale must be > 0")

    def prefill_s(self, uncached: int, cached: int) -> float:
        if uncached <= 0:
            return 0.0
        work = prefill_work(uncached, cached, self.context_scale)
        return self.prefill_overhead_s + self.prefill_s_per_token * work

    def decode_s(self, max_tokens: int) -> float:
        return self.decode_s_per_token * max(0, max_tokens - 1)

    def service_s(self, uncached: int, cached: int, max_tokens: int) -> float:
        return (
            self.request_overhead_s + self.prefill_s(uncached, cached) + self.decode_s(max_tokens)
        )

    def scaled(self, factor: float) -> CostModel:
        """The same model on hardware ``factor`` times slower (>1) or faster (<1)."""
        return replace(
            self,
            name=f"{self.name}x{factor:g}",
            prefill_overhead_s=self.prefill_overhead_s * factor,
            prefill_s_per_token=self.prefill_s_per_token * factor,
            decode_s_per_token=self.decode_s_per_token * factor,
            request_overhead_s=self.request_overhead_s * factor,
            profile=None,  # a profile's figures are not scaled: time by this model instead
        )

    # ------------------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, object]:
        """The JSON form's fields (not ``profile``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "profile"}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> CostModel:
        known = {f.name for f in fields(cls) if f.name != "profile"} | _DOCUMENTATION_KEYS
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown cost model keys: {', '.join(unknown)}")
        kwargs: dict[str, object] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            if f.name in ("name", "source"):
                kwargs[f.name] = str(value)
            elif isinstance(value, int | float) and not isinstance(value, bool):
                kwargs[f.name] = float(value)
            else:
                raise ValueError(f"cost model {f.name} must be a number, got {value!r}")
        return cls(**kwargs)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a cost model is a JSON object")
        return cls.from_dict(data)


def _cpu_tiny() -> CostModel:
    # Fit of GUIDE.md §4 (tiny preset, fp32, 2-core CPU): 540 tokens cold = 46 ms and
    # 90 tokens after 450 cached = 15 ms give, with context_scale 4096,
    # work(540, 0) = 575.6, work(90, 450) = 100.9 -> rate 6.55e-5 s/unit, overhead 8.4 ms.
    return CostModel(
        name="cpu-tiny",
        prefill_overhead_s=0.0084,
        prefill_s_per_token=6.55e-5,
        context_scale=4096.0,
        decode_s_per_token=0.007,
        request_overhead_s=0.002,
        forward_overhead_s=0.002,
        source="fit of GUIDE.md section 4 measurements (tiny preset, 2-core CPU)",
    )


def _gpu_7b() -> CostModel:
    return CostModel(
        name="gpu-7b",
        prefill_overhead_s=0.012,
        prefill_s_per_token=1.0e-4,
        context_scale=8192.0,
        decode_s_per_token=0.020,
        request_overhead_s=0.003,
        forward_overhead_s=0.001,
        source="illustrative assumption: 7B fp16, batch 1, one datacenter GPU (not measured)",
    )


def _gpu_70b() -> CostModel:
    return CostModel(
        name="gpu-70b",
        prefill_overhead_s=0.03,
        prefill_s_per_token=6.0e-4,
        context_scale=8192.0,
        decode_s_per_token=0.05,
        request_overhead_s=0.005,
        forward_overhead_s=0.001,
        source="illustrative assumption: 70B fp16, batch 1, tensor-parallel GPUs (not measured)",
    )


PRESETS = {"cpu-tiny": _cpu_tiny, "gpu-7b": _gpu_7b, "gpu-70b": _gpu_70b}
DEPRECATED = ("gpu-7b", "gpu-70b")  # illustrative, not measured: use a step-time profile

# HTTP work of one forward hop, as `radixmesh calibrate --forward-overhead` defaults to (measured
# on this machine by radixmesh.runtime.bench_forward): not a property of the engine's profile.
PROFILE_FORWARD_OVERHEAD_S = 0.003
PROFILE_DECODE_CONTEXT = 1024  # KV tokens a decode attends to, for the per-token decode cost


# ----------------------------------------------------------- phase-1 adapter: profile -> cost
def from_profile(
    profile: Profile,
    decode_context: int = PROFILE_DECODE_CONTEXT,
    forward_overhead_s: float = PROFILE_FORWARD_OVERHEAD_S,
) -> CostModel:
    """A cost model made from a step-time profile, keeping it (``profile``): the simulated
    engine times its steps with ``profile.step_s``; these batch-1 figures are for the router's
    priors and the sweep's capacity estimate.

    The profile's time for one request served alone: a prefill is one step of ``u`` new tokens
    after ``c`` cached, ``step_base_s + prefill_token_s * u + prefill_attn_s * u * (c + u / 2)``,
    which is this model's ``prefill_overhead + rate * work(u, c)`` with ``rate =
    prefill_token_s`` and ``context_scale = prefill_token_s / prefill_attn_s`` (chunking of
    prompts beyond ``step_tokens`` is ignored: one step overhead, not one per chunk); each
    further token is one batch-1 decode step attending to ``decode_context`` KV tokens. A
    profile's ``prefill_seq_s`` adds to the prefill overhead, its ``admission_s`` is the
    request overhead (both 0 unless the profile has them). Batching, ``max_running`` and the
    KV pool are not in these figures (they are in the simulated engine, which runs the
    scheduler).
    """
    if profile.prefill_attn_s > 0:
        scale = profile.prefill_token_s / profile.prefill_attn_s
    else:
        scale = 1e15  # no attention term: context never doubles a token's cost
    return CostModel(
        name=f"profile:{profile.name}",
        prefill_overhead_s=profile.step_base_s + profile.prefill_seq_s,
        prefill_s_per_token=profile.prefill_token_s,
        context_scale=scale,
        decode_s_per_token=profile.tpot_s(1, decode_context),
        request_overhead_s=profile.admission_s,
        forward_overhead_s=forward_overhead_s,
        source=f"step-time profile {profile.name} at batch 1 ({profile.source})",
        profile=profile,
    )


def resolve(spec: str) -> CostModel:
    """A preset name, a step-time profile (shipped name or ``.toml`` file) or the path of a JSON
    cost model (as written by ``radixmesh calibrate``)."""
    if spec in PRESETS:
        return PRESETS[spec]()
    if spec in shipped_profiles() or spec.endswith(".toml"):
        return from_profile(resolve_profile(spec))
    path = Path(spec)
    if not path.exists():
        names = ", ".join([*PRESETS, *(p for p in shipped_profiles() if p not in PRESETS)])
        raise ValueError(f"cost model {spec!r} is neither a preset or profile ({names}) nor a file")
    return CostModel.load(path)
