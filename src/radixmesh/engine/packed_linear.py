"""The model's linear layers on oneDNN with weights packed once (CPU): batched rows run faster.

Theory of operation
-------------------
A transformers model's ``nn.Linear`` computes ``x W^T + b`` through torch's CPU GEMM (MKL
here). oneDNN with the weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, then ``_linear_pointwise``: the pair torch's own
inductor emits for a frozen CPU linear) has a larger fixed cost per call and a faster kernel
for more rows; where the two cross depends on the CPU and the weight's shape. On an AMD EPYC
box oneDNN won from two rows (``[8, 256] x [256, 1024]`` 0.06 against 0.10 ms); on the Intel
Xeon box of 2026-12-07, 2 threads, MKL won a 256 x 256 weight up to 64 rows (8 rows: 11.8
against 26.8 us), a 1024 x 256 one up to 8 (26.3 against 39.6 us; from 16, 61 against 50),
and the ``mini`` preset's 8,192-row output head from 4 rows (355 against 236 us): with the
two-row rule a decode step of 8 sequences spent 2.2 of its 7.0 ms in oneDNN calls.

So :func:`pack_linears` *measures* the crossover once per distinct weight shape when it packs
a model (:func:`crossover`: both kernels timed on a ladder of row counts, the best of a few
runs each, alternated; the threshold that loses least against the faster of the two at every
rung) and each :class:`PackedLinear` takes oneDNN from its ``min_rows`` (None: never), else
the module's own ``F.linear``. The ladder stops where a call does
``MAX_TUNE_WORK`` multiply-adds (both kernels are compute-bound there: within a few per cent);
the choice moves only the summation order, never the result beyond rounding.

The same arithmetic in fp32 (no lower-precision shortcut): only the summation order of the
kernel differs, so logits move by float rounding (~1e-6 relative), as they already did between
a batch and one row. The module keeps its ``weight`` (the state dict, tied embeddings, LoRA's
shape checks and forward hooks are the stock ones); the packed copy costs the linear weights'
memory once more, so models whose linear weights exceed ``MAX_PACKED_BYTES`` are not packed.
A weight changed in place after packing (its ``_version`` moved) is packed again before use.
Used only where oneDNN is present (``torch.backends.mkldnn``), on CPU, for fp32 and bf16.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

MAX_PACKED_BYTES = 512 << 20  # linear weights larger in all than this are left unpacked
_PACK_ROWS = 8  # the row count oneDNN's reorder is told to expect (any count runs)
LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # row counts :func:`crossover` times ...
MAX_TUNE_WORK = 1 << 25  # ... up to this many multiply-adds a call (the first rung always)
TUNE_RUNS = 5  # runs of each kernel a rung, alternated; the fastest counts
TUNE_RUN_S = 2e-4  # a run repeats its call for about this long


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` with a oneDNN-packed copy of its weight (module docstring)."""

    packed: torch.Tensor
    packed_version: int
    min_rows: int | None  # oneDNN from this many rows on (None: never)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if self.min_rows is None or rows < self.min_rows:
            return super().forward(x)
        if self.weight._version != self.packed_version:
            _pack(self)
        flat = x.reshape(rows, x.shape[-1])
        out: torch.Tensor = _onednn(flat, self.packed, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


def packable(model: nn.Module) -> bool:
    """oneDNN is there, the model is on the CPU in fp32 or bf16, its linear weights are not
    too big to hold twice."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    if not linears or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if not _ops_present():  # private ops: a torch without them runs the stock F.linear
        return False
    w = linears[0].weight
    total = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    return (w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
            and total <= MAX_PACKED_BYTES)


def _ops_present() -> bool:
    try:
        return all(callable(getattr(torch.ops.mkldnn, name))
                   for name in ("_reorder_linear_weight", "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


Crossover = Callable[["PackedLinear"], "int | None"]


def pack_linears(model: nn.Module, rows: Crossover | None = None) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` into a :class:`PackedLinear` (in place,
    when :func:`packable`); how many. ``rows`` gives a packed layer its ``min_rows``
    (default :func:`crossover`, measured once per weight shape, dtype and bias)."""
    if not packable(model):
        return 0
    measure = rows or crossover
    seen: dict[tuple[object, ...], int | None] = {}
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
            _pack(module)  # type: ignore[arg-type]
            key = (*module.weight.shape, module.weight.dtype, module.bias is not None)
            if key not in seen:
                seen[key] = measure(module)  # type: ignore[arg-type]
            module.min_rows = seen[key]  # type: ignore[assignment]
            n += 1
    if n:
        log.info("oneDNN linears from rows (weight [out, in]: rows): %s",
                 {f"{k[0]}x{k[1]}": v for k, v in seen.items()})
    return n


def crossover(layer: PackedLinear) -> int | None:
    """The rows from which oneDNN serves ``layer`` best: both kernels timed at each rung of
    the ladder (up to ``MAX_TUNE_WORK`` multiply-adds a call, where both are compute-bound),
    then the threshold whose choices lose least against the faster kernel of every rung, summed
    as ratios (None: MKL throughout; a tie goes to the higher threshold, the stock kernel)."""
    w, bias = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    rungs = [r for r in LADDER if r == 1 or r * w.numel() <= MAX_TUNE_WORK]
    times: list[tuple[float, float]] = []  # (oneDNN, MKL) seconds a call, per rung
    gen = torch.Generator().manual_seed(0)  # the global RNG stays the caller's
    with torch.inference_mode():
        for r in rungs:
            x = torch.randn(r, w.shape[1], generator=gen).to(w.dtype)
            times.append(_timed(lambda: _onednn(x, layer.packed, bias),  # noqa: B023
                                lambda: F.linear(x, w, bias)))  # noqa: B023
    return threshold(rungs, times)


def threshold(rungs: list[int], times: list[tuple[float, float]]) -> int | None:
    """:func:`crossover`'s choice from its timings (``times[i]``: oneDNN's and MKL's at
    ``rungs[i]``)."""
    best: tuple[float, int | None] = (_loss(times, len(rungs)), None)
    for i in reversed(range(len(rungs))):
        loss = _loss(times, i)
        if loss < best[0]:
            best = (loss, rungs[i])
    return best[1]


def _loss(times: list[tuple[float, float]], first: int) -> float:
    """Summed ratio to the faster kernel when oneDNN serves the rungs from ``first`` on."""
    return sum((dnn if i >= first else mkl) / max(min(dnn, mkl), 1e-12)
               for i, (dnn, mkl) in enumerate(times))


def _timed(a: Callable[[], object], b: Callable[[], object]) -> tuple[float, float]:
    """Seconds a call of ``a`` and of ``b``: the fastest of ``TUNE_RUNS`` runs each,
    alternated."""
    calls = max(1, min(200, int(TUNE_RUN_S / max(_run(a, 1), _run(b, 1), 1e-7))))
    best_a = best_b = float("inf")
    for _ in range(TUNE_RUNS):
        best_a = min(best_a, _run(a, calls))
        best_b = min(best_b, _run(b, calls))
    return best_a, best_b


def _run(f: Callable[[], object], calls: int) -> float:
    """Seconds a call of ``f``, over ``calls`` calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t0) / calls


def _pack(module: PackedLinear) -> None:
    with torch.no_grad():
        module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(),
                                                                _PACK_ROWS)
    module.packed_version = module.weight._version
