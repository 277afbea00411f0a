"""Output lengths drawn from a stated distribution (``--max-tokens``), seeded per request.

Theory of operation
-------------------
A workload generator gives each request its own output budget (``max_tokens``: 1 for MMLU's
one-letter answer, a few hundred for chat). ``--max-tokens SPEC`` replaces it with a draw from
one distribution, so a run says exactly what it asked its engines to generate:

``N``                       every request N tokens (the simulator's ``--max-tokens N``)
``uniform:LO:HI``           an integer uniform in [LO, HI]
``lognormal:MEAN:SIGMA``    a log-normal with that mean (tokens) and log-space sigma: the
                            long right tail of real chat outputs; rounded, at least 1
``exponential:MEAN``        geometric-like: many short answers, a few long ones

every draw capped at ``cap`` (default 32,768; ``:cap=N`` after the parameters, e.g.
``lognormal:256:1:cap=2048``). A request's draw depends on the seed and its id alone (its own
``random.Random``), so every policy, the capacity probe's seed aside, sends the same lengths,
and a request keeps its length whatever else the workload holds. The emulated engines generate
``max_tokens`` unless a stop token of the request cuts them short; a real engine may also stop
at its end-of-sequence token. The records' ``completion_tokens`` say what came.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from radixmesh.workload.request import Request

KINDS = ("fixed", "uniform", "lognormal", "exponential")
DEFAULT_CAP = 32_768


@dataclass(frozen=True, slots=True)
class OutputLengths:
    """One output-length distribution; :meth:`parse` reads the flag's spelling."""

    kind: str
    a: float  # fixed: N; uniform: LO; lognormal, exponential: the mean
    b: float = 0.0  # uniform: HI; lognormal: sigma
    cap: int = DEFAULT_CAP

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"max_tokens: distribution must be one of {', '.join(KINDS)}")
        if self.a < 1 or self.cap < 1:
            raise ValueError("max_tokens: lengths, means and the cap must be >= 1")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError("max_tokens: uniform needs LO <= HI")
        if self.kind == "lognormal" and not self.b >= 0:
            raise ValueError("max_tokens: lognormal needs SIGMA >= 0")

    @classmethod
    def parse(cls, text: str) -> OutputLengths:
        """``64``, ``uniform:16:256``, ``lognormal:128:0.8``, ``exponential:100``, each
        optionally ending ``:cap=N``; ValueError naming the flag."""
        parts = [p.strip() for p in text.strip().split(":")]
        cap = DEFAULT_CAP
        try:
            if parts[-1].startswith("cap="):
                cap = int(parts.pop()[4:])
            if len(parts) == 1:
                return cls("fixed", float(int(parts[0])), cap=cap)
            kind, *nums = parts
            want = {"uniform": 2, "lognormal": 2, "exponential": 1}.get(kind)
            if want is None or len(nums) != want:
                raise ValueError("expected N, uniform:LO:HI, lognormal:MEAN:SIGMA or "
                                 "exponential:MEAN")
            values = [float(n) for n in nums]
            return cls(kind, values[0], values[1] if want == 2 else 0.0, cap)
        except ValueError as exc:
            raise ValueError(f"--max-tokens {text!r}: {exc}") from None

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            n = self.a
        elif self.kind == "uniform":
            n = rng.randint(int(self.a), int(self.b))
        elif self.kind == "lognormal":  # E[X] = exp(mu + sigma^2 / 2) = mean
            mu = math.log(self.a) - self.b * self.b / 2
            n = rng.lognormvariate(mu, self.b)
        else:
            n = rng.expovariate(1.0 / self.a)
        return max(1, min(self.cap, round(n)))

    def apply(self, req: Request, seed: int) -> Request:
        """``req`` with its own draw (by seed and id) as ``max_tokens``."""
        rng = random.Random(f"max_tokens/{seed}/{req.id}")
        return replace(req, max_tokens=self.draw(rng))

    def text(self) -> str:
        """The distribution as a summary names it."""
        cap = "" if self.cap == DEFAULT_CAP else f", cap {self.cap}"
        if self.kind == "fixed":
            return f"{self.a:g} tokens"
        if self.kind == "uniform":
            return f"uniform {self.a:g}-{self.b:g} tokens{cap}"
        if self.kind == "lognormal":
            return f"lognormal mean {self.a:g} tokens, sigma {self.b:g}{cap}"
        return f"exponential mean {self.a:g} tokens{cap}"
