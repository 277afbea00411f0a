"""Step-time profiles: how long one continuous-batching step takes on a GPU/model pair, as TOML.

Theory of operation
-------------------
A batching engine (vLLM, SGLang, the emulated engine, the simulator) runs *steps*: each step
computes some prefill chunks and one token for every decoding sequence (``core/scheduler.py``'s
``Step``). A :class:`Profile` says how long a step takes, as a linear model of what the step
computes::

    step_s = step_base_s                                     weights read, launch, sampling
           + prefill_token_s * (new prefill tokens)          MLP / projections: per token
           + prefill_attn_s  * sum over chunks of tokens * (start + tokens / 2)
                                                             attention: each new token attends
                                                             to the KV before it (causal)
           + decode_seq_s    * (decode sequences)            per-sequence work of a decode
           + decode_kv_s     * (KV tokens the decodes attend to)   KV read by decode attention
           + prefill_seq_s   * (prefill chunks)              optional, 0 when absent: per
                                                             sequence prefilled in the step

and what the engine can hold: ``kv_blocks`` KV blocks of ``block_size`` tokens,
``context_length`` tokens per sequence, ``max_running`` sequences (vLLM ``max_num_seqs``) and
``step_tokens`` tokens computed per step (vLLM ``max_num_batched_tokens``). The prefill terms are
BLIS's linear step model (``beta0 + beta1 * prefill tokens + beta2 * decode tokens``) with an
attention term added; the decode terms separate what grows with the batch from what grows with
its context, so a batch of long conversations costs more than a batch of short ones.

``prefill_seq_s`` is what a sequence's prefill costs the step beyond its tokens: vLLM v1 adds
a new request to its persistent input batch and rebuilds the sampling metadata in the step that
first schedules it (``vllm/v1/worker/gpu_input_batch.py``, used by the CPU model runner too);
on vLLM 0.32 CPU its own ``vllm:request_prefill_time_seconds`` of a 16-token prompt is several
decode steps. A prompt longer than ``step_tokens`` pays it once per chunk.

One time is not a step's: ``admission_s`` (optional, default 0) is how long a request takes from
its arrival at the engine to its joining the scheduler's waiting queue — HTTP parsing,
tokenising, the hop from the API server to the engine core (vLLM v1 runs them in separate
processes: ``vllm/v1/engine/core_client.py``). It delays that one request, never a step, so
requests in flight overlap it with the batch: ``ttft_s`` adds it once, ``step_s`` never.

File format (TOML, flat; every time in seconds)::

    name = "h100-llama3-8b"
    hardware = "1x NVIDIA H100 80GB SXM"
    model = "meta-llama/Llama-3.1-8B-Instruct, bf16"
    source = "where the figures come from, in one line"
    derived = false            # true: no figure for this exact pair was published
    step_base_s = 0.005753     # ... and the other four coefficients
    kv_blocks = 29205          # ints: kv_blocks, block_size, context_length,
    block_size = 16            #       max_running, step_tokens
    context_length = 131072
    max_running = 1024
    step_tokens = 8192
    admission_s = 0.0          # optional (0 when absent): arrival to waiting queue, cited
    prefill_seq_s = 0.0        # optional (0 when absent): per prefill chunk in a step, cited
    cache_rule = "vllm"        # optional ("radix" when absent): SchedulerConfig.cache_rule
    prefix_aware = false       # optional (true when absent): "pioneers first" admission; an
                               # engine emulating vLLM says "vllm" and false (vLLM has neither)

    [citations]                # field -> the published figure it came from and the arithmetic
    step_base_s = "BLIS defaults.yaml beta0 = 5753 us (H100, Llama-3.1-8B, vLLM 0.8.4)"

    [[checks]]                 # published figures the profile must reproduce (tests read them)
    metric = "tpot"            # tpot | ttft | prefill_linear (see Check)
    batch = 16
    context = 512
    published_s = 0.01094
    tolerance = 0.10           # relative
    source = "H100-80GB vLLM FP16 Llama-3-8B TPOT p50 at concurrency 16"

    [[adapters]]               # optional: LoRA adapters the emulated engine serves, by name
    name = "sql-lora"
    # optional: at most lora_slots adapters resident (vLLM's --max-loras); a step that needs
    # another first loads it for lora_load_s (cited: citations.lora_load_s), LRU eviction.
    # 0 slots (the default): every adapter resident, never a load

Every step-time coefficient must carry a citation (a published figure, or ``derived: ...`` saying
from which figure and by what ratio). Loading rejects a missing field, an unknown key, a wrong
type, a negative coefficient (all terms >= 0 make the time monotonic: more work never takes
less), a step with no fixed cost, and impossible capacities (no KV, fewer KV tokens than one
full context — vLLM refuses to start then — ``step_tokens < 1`` ...), with a ValueError naming
the field. :func:`dumps` writes the same format back.

What the form leaves out: published TPOT at high concurrency (e.g. 64 streams) includes the
prefill chunks of arriving requests mixed into decode steps; a profile does not fit those
figures, the scheduler that runs it produces those mixed steps itself. Queueing, HTTP and
tokenization are outside the step too.

Shipped profiles live in ``radixmesh/profiles/*.toml`` (package data): :func:`shipped` lists
them, :func:`resolve` takes a shipped name or a file path.

Why one file over 400 lines: the format, the checks of every field and its writer are one
contract (a field added is read, checked and written here, side by side).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from radixmesh.core.step import CACHE_RULES, SchedulerConfig

COEFFICIENTS = ("step_base_s", "prefill_token_s", "prefill_attn_s", "decode_seq_s", "decode_kv_s")
CAPACITIES = ("kv_blocks", "block_size", "context_length", "max_running", "step_tokens")
TEXTS = ("name", "hardware", "model", "source")
METRICS = ("tpot", "ttft", "prefill_linear")
# seconds, 0 when absent, cited when not 0
OPTIONAL_TIMES = ("lora_load_s", "admission_s", "prefill_seq_s")
# the scheduler's rules, optional (written when not the default)
RULE_DEFAULTS: dict[str, object] = {"cache_rule": "radix", "prefix_aware": True}
RULES = tuple(RULE_DEFAULTS)


# ------------------------------------------------------------------ what step_s reads of a Step
# core/step.py's Step fits these; so does any stand-in with the same attributes (tests, tools).
class PrefillLike(Protocol):
    @property
    def start(self) -> int: ...  # prompt tokens already in KV before this chunk
    @property
    def tokens(self) -> int: ...  # new prompt tokens computed in this chunk


class DecodeLike(Protocol):
    @property
    def context(self) -> int: ...  # KV tokens the new token attends to


class StepLike(Protocol):
    @property
    def prefills(self) -> Sequence[PrefillLike]: ...
    @property
    def decodes(self) -> Sequence[DecodeLike]: ...


@dataclass(frozen=True, slots=True)
class _Chunk:
    start: int
    tokens: int


@dataclass(frozen=True, slots=True)
class _Decode:
    context: int


@dataclass(frozen=True, slots=True)
class _Step:
    prefills: tuple[_Chunk, ...] = ()
    decodes: tuple[_Decode, ...] = ()


# ------------------------------------------------------------------------------------ checks
@dataclass(frozen=True, slots=True)
class Check:
    """A published figure the profile should reproduce within ``tolerance`` (relative).

    ``tpot``: one step of ``batch`` decodes, each attending to ``context`` KV tokens.
    ``ttft``: a ``tokens``-token prompt prefilled alone (in ``step_tokens`` chunks).
    ``prefill_linear``: a ``tokens``-token prefill step without attention (Vidur's
    "non-attention" time; BLIS's linear model).
    """

    metric: str
    published_s: float
    tolerance: float
    source: str
    batch: int = 1
    context: int = 0
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"checks.metric must be one of {', '.join(METRICS)}")
        if not self.published_s > 0:
            raise ValueError("checks.published_s must be > 0")
        if not 0 < self.tolerance <= 1:
            raise ValueError("checks.tolerance must be in (0, 1]")
        if self.batch < 1 or self.context < 0 or self.tokens < 0:
            raise ValueError("checks.batch must be >= 1, checks.context/tokens >= 0")
        if self.metric != "tpot" and self.tokens < 1:
            raise ValueError(f"checks.tokens must be >= 1 for metric {self.metric}")


# ----------------------------------------------------------------------------------- profile
@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    hardware: str
    model: str
    source: str
    derived: bool
    step_base_s: float
    prefill_token_s: float
    prefill_attn_s: float
    decode_seq_s: float
    decode_kv_s: float
    kv_blocks: int
    block_size: int
    context_length: int
    max_running: int
    step_tokens: int
    citations: Mapping[str, str] = field(default_factory=dict)
    checks: tuple[Check, ...] = ()
    adapters: tuple[str, ...] = ()  # LoRA adapters served by name (the emulated engine)
    lora_slots: int = 0  # adapters resident at once (0: all, never loaded)
    lora_load_s: float = 0.0  # loading a cold adapter stalls its step this long
    admission_s: float = 0.0  # a request's arrival to its joining the waiting queue
    prefill_seq_s: float = 0.0  # a step's cost per prefill chunk beyond its tokens
    cache_rule: str = "radix"  # the scheduler's caching rule (SchedulerConfig.cache_rule)
    prefix_aware: bool = True  # the scheduler's "pioneers first" admission (False: FCFS)

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
            if name not in self.citations:
                raise ValueError(f"{name} has no citation (citations.{name})")
        if self.lora_slots < 0:
            raise ValueError("lora_slots must be >= 0")
        if self.cache_rule not in CACHE_RULES:
            raise ValueError(f"cache_rule must be one of {', '.join(CACHE_RULES)}")
        for name in OPTIONAL_TIMES:
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
            if value and name not in self.citations:
                raise ValueError(f"{name} has no citation (citations.{name})")
        if self.step_base_s <= 0:
            raise ValueError("step_base_s must be > 0 (every step has a fixed cost)")
        for name in CAPACITIES:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.context_length < self.block_size:
            raise ValueError("context_length must be >= block_size")
        if self.kv_blocks * self.block_size < self.context_length:
            raise ValueError(
                f"kv_blocks: {self.kv_blocks} blocks of {self.block_size} tokens hold less than "
                f"one context of {self.context_length} tokens"
            )
        known = {*COEFFICIENTS, *CAPACITIES, *OPTIONAL_TIMES}
        unknown = sorted(set(self.citations) - known)
        if unknown:
            raise ValueError(f"citations: unknown fields {', '.join(unknown)}")

    # ------------------------------------------------------------------------ step time
    def step_s(self, step: StepLike) -> float:
        """Seconds the step takes (the module docstring's formula)."""
        new = attn = 0.0
        for chunk in step.prefills:
            new += chunk.tokens
            attn += chunk.tokens * (chunk.start + chunk.tokens / 2)
        kv = sum(d.context for d in step.decodes)
        return (
            self.step_base_s
            + self.prefill_seq_s * len(step.prefills)
            + self.prefill_token_s * new
            + self.prefill_attn_s * attn
            + self.decode_seq_s * len(step.decodes)
            + self.decode_kv_s * kv
        )

    def tpot_s(self, batch: int, context: int) -> float:
        """One decode step of ``batch`` sequences, each attending to ``context`` KV tokens."""
        return self.step_s(_Step(decodes=(_Decode(context),) * batch))

    def ttft_s(self, prompt: int, cached: int = 0) -> float:
        """A ``prompt``-token prompt (``cached`` of it reused) prefilled alone, chunk by chunk,
        after its admission."""
        total, start = self.admission_s, cached
        while start < prompt:
            tokens = min(self.step_tokens, prompt - start)
            total += self.step_s(_Step(prefills=(_Chunk(start, tokens),)))
            start += tokens
        return total

    def predicted_s(self, check: Check) -> float:
        if check.metric == "tpot":
            return self.tpot_s(check.batch, check.context)
        if check.metric == "ttft":
            return self.ttft_s(check.tokens)
        return self.step_base_s + self.prefill_token_s * check.tokens

    def scheduler_config(self, **overrides: Any) -> SchedulerConfig:
        """The scheduler's configuration for this engine (``overrides`` win)."""
        values: dict[str, Any] = {
            "block_size": self.block_size,
            "kv_blocks": self.kv_blocks,
            "max_running": self.max_running,
            "step_tokens": self.step_tokens,
            "cache_rule": self.cache_rule,
            "prefix_aware": self.prefix_aware,
        }
        values.update(overrides)
        return SchedulerConfig(**values)

    # ---------------------------------------------------------------------------- TOML
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "citations":
                out[f.name] = dict(value)
            elif f.name == "checks":
                out[f.name] = [{g.name: getattr(c, g.name) for g in fields(Check)} for c in value]
            elif f.name == "adapters":
                out[f.name] = [{"name": name} for name in value]
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown profile keys: {', '.join(unknown)}")
        kwargs: dict[str, Any] = {}
        for name in (*TEXTS, "derived", *COEFFICIENTS, *CAPACITIES):
            if name not in data:
                raise ValueError(f"{name}: missing")
            kwargs[name] = _typed(name, data[name])
        kwargs["citations"] = _citations(data.get("citations", {}))
        kwargs["checks"] = tuple(_check(c) for c in _table_list(data.get("checks", [])))
        for name in ("lora_slots", *OPTIONAL_TIMES, *RULES):
            if name in data:
                kwargs[name] = _typed(name, data[name])
        kwargs["adapters"] = tuple(_adapter(a) for a in _table_list(data.get("adapters", []),
                                                                    "adapters"))
        return cls(**kwargs)

    @classmethod
    def loads(cls, text: str, where: str = "profile") -> Profile:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{where}: not TOML: {exc}") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.loads(Path(path).read_text(encoding="utf-8"), str(path))


def _typed(name: str, value: object) -> object:
    if name in TEXTS:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string")
        return value
    if name in ("derived", "prefix_aware"):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false")
        return value
    if name == "cache_rule":
        if value not in CACHE_RULES:
            raise ValueError(f"cache_rule must be one of {', '.join(CACHE_RULES)}, got {value!r}")
        return value
    if name in (*CAPACITIES, "lora_slots"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _citations(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ValueError("citations must be a table")
    for key, text in value.items():
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"citations.{key} must be a non-empty string")
    return dict(value)


def _table_list(value: object, what: str = "checks") -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"{what} must be an array of tables ([[{what}]])")
    return value


def _adapter(data: dict[str, Any]) -> str:
    name = data.get("name")
    if set(data) != {"name"} or not isinstance(name, str) or not 0 < len(name) <= 128:
        raise ValueError("adapters: each is {name = \"1-128 characters\"} and nothing else")
    return name


def _check(data: dict[str, Any]) -> Check:
    known = {f.name for f in fields(Check)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown checks keys: {', '.join(unknown)}")
    for name in ("metric", "published_s", "tolerance", "source"):
        if name not in data:
            raise ValueError(f"checks.{name}: missing")
    for name in ("batch", "context", "tokens"):
        if name in data and (isinstance(data[name], bool) or not isinstance(data[name], int)):
            raise ValueError(f"checks.{name} must be an integer")
    for name in ("published_s", "tolerance"):
        if isinstance(data[name], bool) or not isinstance(data[name], int | float):
            raise ValueError(f"checks.{name} must be a number")
    if not isinstance(data["metric"], str) or not isinstance(data["source"], str):
        raise ValueError("checks.metric and checks.source must be strings")
    return Check(
        **{**data, "published_s": float(data["published_s"]), "tolerance": float(data["tolerance"])}
    )


# ------------------------------------------------------------------------------- TOML writer
def dumps(profile: Profile) -> str:
    """The profile as TOML in the module docstring's format (``Profile.loads`` reads it back)."""
    data = profile.to_dict()
    lines = [f"{key} = {_value(data[key])}" for key in (*TEXTS, "derived", *COEFFICIENTS)]
    lines += [f"{key} = {_value(data[key])}" for key in CAPACITIES]
    lines += [f"{key} = {_value(data[key])}" for key in ("lora_slots", *OPTIONAL_TIMES)
              if data[key]]
    lines += [f"{key} = {_value(data[key])}" for key in RULES
              if data[key] != RULE_DEFAULTS[key]]
    lines += ["", "[citations]"]
    lines += [f"{key} = {_value(text)}" for key, text in data["citations"].items()]
    for check in data["checks"]:
        lines += ["", "[[checks]]"]
        lines += [f"{key} = {_value(value)}" for key, value in check.items()]
    for adapter in data["adapters"]:
        lines += ["", "[[adapters]]", f"name = {_value(adapter['name'])}"]
    return "\n".join(lines) + "\n"


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # shortest round-tripping form; TOML accepts 1e-05 and 0.25
    if isinstance(value, str):
        return '"' + "".join(_escape(ch) for ch in value) + '"'
    raise TypeError(f"cannot write {type(value).__name__} to a profile")


def _escape(ch: str) -> str:
    """One character of a TOML basic string: quote and backslash escaped, controls as \\uXXXX."""
    if ch in ('"', "\\"):
        return "\\" + ch
    return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch


# ------------------------------------------------------------------------- shipped profiles
def shipped() -> list[str]:
    """Names of the profiles shipped in ``radixmesh/profiles``."""
    folder = resources.files("radixmesh.profiles")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def resolve(spec: str) -> Profile:
    """A shipped profile's name, or the path of a profile TOML file."""
    if spec in shipped():
        text = resources.files("radixmesh.profiles").joinpath(f"{spec}.toml").read_text("utf-8")
        return Profile.loads(text, f"profile {spec}")
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"profile {spec!r} is neither shipped ({', '.join(shipped())}) nor a file")
    return Profile.load(path)
