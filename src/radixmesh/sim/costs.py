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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from radixmesh.core.estimators import prefill_work

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
        )

    # ------------------------------------------------------------------------------ JSON
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> CostModel:
        known = {f.name for f in fields(cls)} | _DOCUMENTATION_KEYS
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


def resolve(spec: str) -> CostModel:
    """A preset name or the path of a JSON cost model (as written by ``radixmesh calibrate``)."""
    if spec in PRESETS:
        return PRESETS[spec]()
    path = Path(spec)
    if not path.exists():
        names = ", ".join(PRESETS)
        raise ValueError(f"cost model {spec!r} is neither a preset ({names}) nor a file")
    return CostModel.load(path)
