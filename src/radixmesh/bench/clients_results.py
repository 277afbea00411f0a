"""``make clients-check``'s results: what one tool run did, the per-sample comparison of the
same lm-eval run against both targets, guidellm's rows, and the report's tables
(``bench/clients_check.py``'s step 4).

Theory of operation
-------------------
A :class:`ToolRun` holds one lm-eval or guidellm process's exit status, wall time, the load
average around it and what it wrote: lm-eval's ``--log_samples`` (:func:`load_samples`), its
request phase (:func:`request_seconds`: its last "Requesting API" progress bar, n / average
rate) and evaluation time, the failures its log reports (:func:`harness_failures`); guidellm's
JSON report becomes :class:`GuideRow` s. :func:`compare` matches the samples of one run against
the single node and against the mesh by task and doc id: texts must be equal, log-likelihoods
within :data:`LOGPROB_TOLERANCE` with the same choice picked, and the metric equal — routing
must never change an answer. :func:`lm_eval_table`, :func:`guidellm_table` and
:func:`failures_text` are the parts of the report (``clients_check.report_lines``).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TARGETS = ("single", "mesh")
LOGPROB_TOLERANCE = 1e-4  # |Δ log-likelihood| still called the same (fp32 reduction order)


# ------------------------------------------------------------------------------ tool runs
@dataclass
class ToolRun:
    name: str
    target: str
    argv: list[str]
    rc: int = -1
    wall_s: float = 0.0
    eval_s: float | None = None  # lm-eval's total_evaluation_time_seconds
    request_s: float | None = None  # its "Requesting API" phase (see request_seconds)
    load: tuple[float, float] = (math.nan, math.nan)  # 1-min load average before, after
    log: str = ""
    samples: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # what the harness reported failing

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.failures


@dataclass
class TargetResult:
    target: str
    nodes: int
    runs: list[ToolRun] = field(default_factory=list)
    counters: dict[str, dict[str, float]] = field(default_factory=dict)  # per run
    guidellm: list[GuideRow] = field(default_factory=list)
    guidellm_run: ToolRun | None = None


_FAILURE = re.compile(r"(API request failed.*|Exception:.*|Traceback.*|\w+Error: .*)")


def harness_failures(log: Path, limit: int = 6) -> list[str]:
    """The lines where lm-eval reports a failed request or an error (request + response)."""
    seen: list[str] = []
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        m = _FAILURE.search(line)
        if m and m.group(1) not in seen:
            seen.append(m.group(1)[:2000])
        if len(seen) >= limit:
            break
    return seen


def load_samples(out: Path) -> dict[str, dict[str, Any]]:
    """``--log_samples`` files under ``out`` → {"task/doc_id": sample}."""
    samples: dict[str, dict[str, Any]] = {}
    for path in sorted(out.rglob("samples_*.jsonl")):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                s = json.loads(line)
                samples[f"{task}/{s['doc_id']}"] = s
    return samples


_BAR = re.compile(r"Requesting API: 100%\|[^|]*\| (\d+)/\1 \[[^,\]]*, *([\d.]+)(it/s|s/it)\]")


def request_seconds(log: Path) -> float | None:
    """The harness's request phase: its last "Requesting API" bar, n / (average rate)."""
    text = log.read_text(encoding="utf-8", errors="replace")
    found = _BAR.findall(text)
    if not found:
        return None
    n, rate, unit = int(found[-1][0]), float(found[-1][1]), found[-1][2]
    if rate <= 0:
        return None
    return n / rate if unit == "it/s" else n * rate


def eval_seconds(out: Path) -> float | None:
    for path in sorted(out.rglob("results_*.json")):
        value = json.loads(path.read_text(encoding="utf-8")).get("total_evaluation_time_seconds")
        with contextlib.suppress(TypeError, ValueError):
            return float(value)
    return None


# ------------------------------------------------------------------------------ comparison
@dataclass
class Comparison:
    run: str
    samples: int = 0  # compared (present in both)
    identical: int = 0
    only_one_side: int = 0
    max_logprob_diff: float = 0.0
    diffs: list[str] = field(default_factory=list)  # the first few differing samples

    @property
    def ok(self) -> bool:
        return self.samples > 0 and self.identical == self.samples and not self.only_one_side


def _answers(sample: Mapping[str, Any]) -> Any:
    return sample.get("filtered_resps", sample.get("resps"))


def _logprobs(sample: Mapping[str, Any]) -> list[float]:
    """The log-likelihood of each choice (loglikelihood samples: ``resps`` holds
    ``[[logprob, is_greedy]]`` per choice, written as strings), else empty."""
    out: list[float] = []
    for resp in sample.get("resps") or []:
        first = resp[0] if isinstance(resp, list) and resp else None
        if isinstance(first, list | tuple) and len(first) == 2:
            with contextlib.suppress(TypeError, ValueError):
                out.append(float(first[0]))
    return out


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[bool, float]:
    """(same answer, |Δ log-likelihood|): texts exactly; log-likelihoods within tolerance and
    the same choice picked; the metric (acc / exact_match) equal."""
    la, lb = _logprobs(a), _logprobs(b)
    metrics = [k for k in ("acc", "exact_match") if k in a or k in b]
    same_metric = all(a.get(k) == b.get(k) for k in metrics)
    if la or lb:
        if len(la) != len(lb):
            return False, math.inf
        diff = max((abs(x - y) for x, y in zip(la, lb, strict=True)), default=0.0)
        argmax_a = max(range(len(la)), key=la.__getitem__)
        argmax_b = max(range(len(lb)), key=lb.__getitem__)
        return same_metric and argmax_a == argmax_b and diff <= LOGPROB_TOLERANCE, diff
    return same_metric and _answers(a) == _answers(b), 0.0


def compare(run: str, single: Mapping[str, Mapping[str, Any]],
            mesh: Mapping[str, Mapping[str, Any]], show: int = 5) -> Comparison:
    c = Comparison(run)
    c.only_one_side = len(set(single) ^ set(mesh))
    for key in sorted(set(single) & set(mesh)):
        c.samples += 1
        same, diff = _same(single[key], mesh[key])
        if math.isfinite(diff):
            c.max_logprob_diff = max(c.max_logprob_diff, diff)
        if same:
            c.identical += 1
        elif len(c.diffs) < show:
            c.diffs.append(f"{key}: single {_answers(single[key])!r} vs mesh "
                           f"{_answers(mesh[key])!r}")
    return c


# ------------------------------------------------------------------------------ guidellm
@dataclass
class GuideRow:
    target: str
    strategy: str
    ok: int
    errored: int
    incomplete: int
    req_s: float
    out_tok_s: float
    ttft_ms_p50: float
    ttft_ms_p95: float
    itl_ms_p50: float
    itl_ms_mean: float


def _stat(metrics: Mapping[str, Any], name: str, stat: str) -> float:
    """A statistic over the successful requests (NaN when none succeeded)."""
    if not (metrics.get("request_totals") or {}).get("successful"):
        return math.nan
    dist = (metrics.get(name) or {}).get("successful") or {}
    value = dist.get("percentiles", {}).get(stat) if stat.startswith("p") else dist.get(stat)
    return float(value) if isinstance(value, int | float) else math.nan


def _strategy(config: Mapping[str, Any]) -> str:
    s = config.get("strategy") or {}
    kind = str(s.get("type_", "?"))
    rate = s.get("rate")
    if isinstance(rate, int | float):
        return f"{kind}@{rate:.2f}/s"
    if kind == "throughput" and s.get("max_concurrency"):
        return f"throughput@{s['max_concurrency']}"
    return kind


def guidellm_rows(target: str, report: Path) -> list[GuideRow]:
    data = json.loads(report.read_text(encoding="utf-8"))
    rows: list[GuideRow] = []
    for b in data.get("benchmarks", []):
        m, totals = b.get("metrics", {}), b.get("metrics", {}).get("request_totals", {})
        rows.append(GuideRow(
            target, _strategy(b.get("config", {})), int(totals.get("successful", 0)),
            int(totals.get("errored", 0)), int(totals.get("incomplete", 0)),
            _stat(m, "requests_per_second", "mean"), _stat(m, "output_tokens_per_second", "mean"),
            _stat(m, "time_to_first_token_ms", "p50"), _stat(m, "time_to_first_token_ms", "p95"),
            _stat(m, "inter_token_latency_ms", "p50"), _stat(m, "inter_token_latency_ms", "mean"),
        ))
    return rows


# ------------------------------------------------------------------------------ report
def _fmt(x: float, digits: int = 1) -> str:
    return "—" if not math.isfinite(x) else f"{x:.{digits}f}"


def lm_eval_table(results: Mapping[str, TargetResult], comparisons: Sequence[Comparison]
                  ) -> list[str]:
    lines = ["| lm-eval run | samples | identical | max Δlogprob | requests s single / mesh | "
             "mesh/single | lm-eval wall s single / mesh | cache-hit tokens single / mesh | "
             "load avg single / mesh |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        s, m = (_run(results[t], c.run) for t in TARGETS)
        rs = s.request_s if s and s.request_s is not None else math.nan
        rm = m.request_s if m and m.request_s is not None else math.nan
        walls = " / ".join(_fmt(r.wall_s) if r else "—" for r in (s, m))
        hits = " / ".join(_hits(results[t], c.run) for t in TARGETS)
        loads = " / ".join(_fmt(max(r.load)) if r else "—" for r in (s, m))
        lines.append(f"| {c.run} | {c.samples} | {c.identical} | {c.max_logprob_diff:.2g} | "
                     f"{_fmt(rs, 2)} / {_fmt(rm, 2)} | {_fmt(rm / rs, 2) if rs else '—'} | "
                     f"{walls} | {hits} | {loads} |")
    return lines


def _run(result: TargetResult, name: str) -> ToolRun | None:
    return next((r for r in result.runs if r.name == name), None)


def _hits(result: TargetResult, name: str) -> str:
    c = result.counters.get(name, {})
    if "prompt_tokens" not in c:
        return "n/a"
    share = c.get("cache_hit_tokens", 0.0) / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
    return f"{share:.0%} of {c['prompt_tokens']:.0f}"


def guidellm_table(rows: Sequence[GuideRow]) -> list[str]:
    lines = ["| target | strategy | ok / err / incomplete | req/s | output tok/s | "
             "TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL mean ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.target} | {r.strategy} | {r.ok} / {r.errored} / {r.incomplete} | "
                     f"{_fmt(r.req_s, 2)} | {_fmt(r.out_tok_s)} | {_fmt(r.ttft_ms_p50)} | "
                     f"{_fmt(r.ttft_ms_p95)} | {_fmt(r.itl_ms_p50)} | {_fmt(r.itl_ms_mean)} |")
    return lines


def failures_text(results: Mapping[str, TargetResult]) -> list[str]:
    lines: list[str] = []
    for res in results.values():
        runs = [*res.runs, *([res.guidellm_run] if res.guidellm_run else [])]
        for run in runs:
            if not run.ok:
                lines.append(f"- {run.target} / {run.name} FAILED (rc {run.rc}, log {run.log}):")
                lines += [f"    {f}" for f in run.failures]
    return lines


def samples_of(result: TargetResult, name: str) -> dict[str, dict[str, Any]]:
    run = _run(result, name)
    return run.samples if run else {}
