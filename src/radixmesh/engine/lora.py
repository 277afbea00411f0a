"""PEFT LoRA adapters on the built-in engine: read from local folders, applied row by row.

Theory of operation
-------------------
Format: PEFT's on-disk LoRA adapter (what ``PeftModel.save_pretrained`` writes), a folder with

* ``adapter_config.json``: ``peft_type`` "LORA", ``r``, ``lora_alpha``, ``use_rslora``,
  ``target_modules``, ... ;
* ``adapter_model.safetensors``: for each adapted linear layer of the base model,
  ``base_model.model.<module path>.lora_A.weight`` ``[r, in]`` and ``....lora_B.weight``
  ``[out, r]``.

The layer then computes ``W x + scaling * B (A x)``, ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``): peft/tuners/lora/layer.py, ``update_layer``.
The tensors name the layers, so ``target_modules`` is not matched again, and each layer's
``r`` is its A's row count (so a ``rank_pattern`` needs nothing more). Refused with a
``ValueError`` naming the field or tensor (a node does not start): another ``peft_type``,
DoRA, ``bias`` other than "none", ``modules_to_save``, ``alpha_pattern``, ``fan_in_fan_out``,
LoRA on embeddings or on the output head, a layer the model lacks or is not ``nn.Linear``, a
shape that does not fit, a pickled ``adapter_model.bin`` only (never unpickled).

Execution. Each adapted ``nn.Linear`` gets one forward hook (installed when the first adapter
naming it is loaded; the module tree and its ``state_dict`` stay the model's own) that adds
the deltas of the rows *bound* for the current forward. Around a step's forward the runner
binds each row to its sequence's adapter (:func:`bound`: rows in ``BatchRunner``'s packing
order, prefill chunks then decodes); a pre-hook on the model hands each forward the next rows,
so a step run as consecutive pieces works alike. Rows are grouped by adapter, and a hooked
layer adds ``(x[rows] A^T) (scaling B)^T`` for each group in place (``index_add_``;
``addmm_`` when one adapter covers the forward): two thin matmuls per adapter present (the
segment idea of Punica's SGMV, in plain torch), nothing when no row has one. (A per-token
gather of A and B would materialise ``[tokens, r, in]`` per layer; not tried.) Outside a bound
forward (HF ``generate`` on the model, a reference) the hooks add nothing. Mixed-adapter
throughput: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from radixmesh.core.scheduler import SeqId, Step
from radixmesh.engine.base import GenerateRequest

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
# fields whose non-default values change the computation in ways not implemented here
_REFUSED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
            "alpha_pattern": {}, "layer_replication": None}

LoraFactors = tuple[torch.Tensor, torch.Tensor]  # A^T [in, r], (scaling * B)^T [r, out]
AdapterRun = tuple[str | None, int]  # consecutive rows of one adapter (None: the base model)


class HasRequest(Protocol):
    req: GenerateRequest


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """One adapter read from its folder: module path -> (A^T, (scaling * B)^T)."""

    name: str
    layers: Mapping[str, LoraFactors]

    @property
    def rank(self) -> int:
        return max(at.shape[1] for at, _ in self.layers.values())


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"adapter {folder}: cannot read {CONFIG}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"adapter {folder}: {CONFIG} must be a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {folder}: peft_type {config['peft_type']!r} is not LORA")
    for key, default in _REFUSED.items():
        if config.get(key, default) not in (default, None, [], {}, False):
            raise ValueError(f"adapter {folder}: {key}={config[key]!r} is not supported")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise ValueError(f"adapter {folder}: lora_alpha must be a positive number")
    return config


def read_adapter(name: str, folder: Path, model: torch.nn.Module) -> LoraWeights:
    """Read and check a PEFT LoRA folder against ``model`` (module docstring)."""
    config = read_config(folder)
    path = folder / WEIGHTS
    if not path.is_file():
        extra = " (adapter_model.bin is not read: convert it to safetensors)" if (
            folder / "adapter_model.bin").is_file() else ""
        raise ValueError(f"adapter {folder}: no {WEIGHTS}{extra}")
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"adapter {folder}: cannot read {WEIGHTS}: {exc}") from None
    pairs = _pairs(folder, tensors)
    if not pairs:
        raise ValueError(f"adapter {folder}: {WEIGHTS} holds no lora_A / lora_B weights")
    modules = dict(model.named_modules())
    head = getattr(model, "get_output_embeddings", lambda: None)()
    param = next(model.parameters())
    layers: dict[str, LoraFactors] = {}
    for module, (a, b) in sorted(pairs.items()):
        layer = modules.get(module)
        if not isinstance(layer, torch.nn.Linear) or layer is head:
            raise ValueError(f"adapter {folder}: {module} is not a linear layer of the model "
                             "(the output head and embeddings are not supported)")
        r = a.shape[0]
        if a.shape != (r, layer.in_features) or b.shape != (layer.out_features, r):
            raise ValueError(f"adapter {folder}: {module}: lora_A {tuple(a.shape)} / lora_B "
                             f"{tuple(b.shape)} do not fit {layer.in_features} -> "
                             f"{layer.out_features}")
        alpha = float(config["lora_alpha"])
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        layers[module] = (a.t().contiguous().to(param.device, param.dtype),
                          (b.double() * scaling).t().contiguous().to(param.device, param.dtype))
    return LoraWeights(name, layers)


def _pairs(folder: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, LoraFactors]:
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if not key.startswith(_PREFIX) or suffix is None or tensor.dim() != 2:
            raise ValueError(f"adapter {folder}: tensor {key} is not a LoRA A/B weight of a "
                             "linear layer")
        found.setdefault(key[len(_PREFIX):-len(suffix)], {})[suffix] = tensor
    out = {}
    for module, ab in found.items():
        if len(ab) != 2:
            raise ValueError(f"adapter {folder}: {module} lacks lora_A or lora_B")
        out[module] = (ab[_SUFFIXES[0]], ab[_SUFFIXES[1]])
    return out


class LoraSet:
    """The adapters an engine serves, and the row groups bound for the current forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.adapters: dict[str, LoraWeights] = {}
        self._slot: dict[str, int] = {}  # name -> its index in each layer's table
        self._tables: dict[str, dict[int, LoraFactors]] = {}  # module path -> slot -> pair
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # (slot, rows: None = all)
        self.pending: list[AdapterRun] = []  # the bound step's rows the model has not run yet
        model.register_forward_pre_hook(self._next_forward, with_kwargs=True)

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def load(self, name: str, folder: Path) -> LoraWeights:
        if not name or name in self.adapters:
            raise ValueError(f"adapter name {name!r}: empty or loaded twice")
        weights = read_adapter(name, folder, self.model)
        slot = self._slot[name] = len(self._slot)
        modules = dict(self.model.named_modules())
        for module, pair in weights.layers.items():
            table = self._tables.get(module)
            if table is None:
                table = self._tables[module] = {}
                modules[module].register_forward_hook(self._hook(table))
            table[slot] = pair
        self.adapters[name] = weights
        return weights

    def _next_forward(self, _model: torch.nn.Module, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> None:
        """A forward of the model starts: it runs the next rows of the bound step (a step may
        run as several consecutive forwards: its rows in packing order, piece by piece)."""
        if not self.pending:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else 0
        take: list[AdapterRun] = []
        while n > 0 and self.pending:
            name, rows = self.pending[0]
            used = min(rows, n)
            take.append((name, used))
            n -= used
            if used == rows:
                self.pending.pop(0)
            else:
                self.pending[0] = (name, rows - used)
        self.bind_rows(take)

    def _hook(self, table: dict[int, LoraFactors]) -> Any:
        def add_deltas(_module: torch.nn.Module, args: tuple[torch.Tensor, ...],
                       out: torch.Tensor) -> torch.Tensor:
            if not self.groups:
                return out
            x = args[0].reshape(-1, args[0].shape[-1])
            flat = out.view(-1, out.shape[-1])
            for slot, rows in self.groups:
                pair = table.get(slot)
                if pair is None:
                    continue
                at, bt = pair  # A^T [in, r], (scaling B)^T [r, out]
                if rows is None:
                    flat.addmm_(x @ at, bt)
                else:
                    flat.index_add_(0, rows, (x.index_select(0, rows) @ at) @ bt)
            return out
        return add_deltas

    def bind_rows(self, names: Sequence[AdapterRun]) -> None:
        """Bind consecutive runs of rows: ``(adapter name or None, rows)`` in packing order."""
        if all(name is None for name, _ in names):
            self.groups = []
            return
        first = names[0][0]
        if all(name == first for name, _ in names):
            self.groups = [(self._slot[first], None)] if first is not None else []
            return
        rows: dict[str, list[int]] = {}
        at = 0
        for name, n in names:
            if name is not None:
                rows.setdefault(name, []).extend(range(at, at + n))
            at += n
        device = next(self.model.parameters()).device
        self.groups = [(self._slot[name], torch.tensor(r, dtype=torch.long, device=device))
                       for name, r in rows.items()]


@contextlib.contextmanager
def bound(lora: LoraSet | None, step: Step, live: Mapping[SeqId, HasRequest]) -> Iterator[None]:
    """Within: the forwards of ``step`` (model positions; in ``BatchRunner``'s packing order:
    prefill chunks, then decodes, in one forward or in consecutive pieces) run each row with its
    sequence's adapter."""
    if lora is None or not lora.adapters:
        yield
        return
    runs: list[AdapterRun] = [(live[c.seq].req.adapter, c.tokens) for c in step.prefills]
    runs += [(live[d.seq].req.adapter, 1) for d in step.decodes]
    lora.pending = runs if any(name is not None for name, _ in runs) else []
    try:
        yield
    finally:
        lora.pending, lora.groups = [], []


@contextlib.contextmanager
def only(lora: LoraSet | None, adapter: str | None) -> Iterator[None]:
    """Within: every row of every forward runs with ``adapter`` (None: the base model)."""
    if lora is None or adapter is None:
        yield
        return
    lora.bind_rows([(adapter, 1)])  # one adapter for all: whole rows, whatever their number
    try:
        yield
    finally:
        lora.groups = []
