"""The model's linear layers on oneDNN with weights packed once (CPU): batched rows run faster.

Theory of operation
-------------------
A transformers model's ``nn.Linear`` computes ``x W^T + b`` through torch's CPU GEMM (MKL
here). For the few rows of a decode step that is slow: on the 2-core AMD EPYC box, one thread,
``[8, 256] x [256, 8192]`` (the ``mini`` preset's output head over a batch of 8) took ~0.95 ms
through ``F.linear`` and ~0.34 ms through oneDNN with the weight reordered once into its
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, then ``_linear_pointwise``: the
pair torch's own inductor emits for a frozen CPU linear); an MLP layer's ``[8, 256] x
[256, 1024]`` 0.10 against 0.06 ms; a 512-row prefill piece ~10 % faster. For one row of a
small weight oneDNN's fixed cost per call (~25 us) loses to MKL (a 256 x 256 weight: ~27
against ~7 us), so :func:`pack_linears` turns each ``nn.Linear`` into a :class:`PackedLinear`
that takes oneDNN for two rows or more, or for any row count when the weight has at least
``BIG_WEIGHT`` elements (the output head), else the module's own ``F.linear``.

The same arithmetic in fp32 (no lower-precision shortcut): only the summation order of the
kernel differs, so logits move by float rounding (~1e-6 relative), as they already did between
a batch and one row. The module keeps its ``weight`` (the state dict, tied embeddings, LoRA's
shape checks and forward hooks are the stock ones); the packed copy costs the linear weights'
memory once more, so models whose linear weights exceed ``MAX_PACKED_BYTES`` are not packed.
A weight changed in place after packing (its ``_version`` moved) is packed again before use.
Used only where oneDNN is present (``torch.backends.mkldnn``), on CPU, for fp32 and bf16.
"""

from __future__ import annotations

import torch
from torch import nn

BIG_WEIGHT = 1 << 20  # elements: one row through oneDNN beats MKL from about here (4 MiB fp32)
MAX_PACKED_BYTES = 512 << 20  # linear weights larger in all than this are left unpacked
_PACK_ROWS = 8  # the row count oneDNN's reorder is told to expect (any count runs)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` with a oneDNN-packed copy of its weight (module docstring)."""

    packed: torch.Tensor
    packed_version: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if rows < 2 and self.weight.numel() < BIG_WEIGHT:
            return super().forward(x)
        if self.weight._version != self.packed_version:
            _pack(self)
        flat = x.reshape(rows, x.shape[-1])
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias,
                                                               "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


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


def pack_linears(model: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` into a :class:`PackedLinear` (in place,
    when :func:`packable`); how many."""
    if not packable(model):
        return 0
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
            _pack(module)  # type: ignore[arg-type]
            n += 1
    return n


def _pack(module: PackedLinear) -> None:
    with torch.no_grad():
        module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(),
                                                                _PACK_ROWS)
    module.packed_version = module.weight._version
