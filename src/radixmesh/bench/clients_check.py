"""``make clients-check``: clients nobody here wrote — lm-evaluation-harness and guidellm — run
against a 4-node mesh and against one node, and their results compared.

Theory of operation
-------------------
Everything lives in one run folder (``--out``, default ``runs/clients``):

1. ``model/``: a random-weight ``tiny`` model directory with a byte-level BPE trained here on
   the copied MMLU subset (:func:`radixmesh.engine.testing.save_random_model_dir`), so the
   harness, guidellm and the nodes load the very same tokenizer from a local path — nothing
   comes from a hub (``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1`` in the tools' env).
2. ``data/`` + ``tasks/``: a small MMLU subset (``--subjects``, ``--questions`` test rows each,
   the 5 dev rows as the few-shot set) as JSON-lines files, and lm-eval task files (JSON is
   YAML) reading them with the ``json`` dataset builder: per subject one loglikelihood task
   (``multiple_choice``) and one ``generate_until`` task, MMLU's 5-shot format (header + the
   same 5 dev rows first), so the few-shot prefix repeats for every question of a subject.
   Tags ``rmcc_loglik`` / ``rmcc_gen`` group them.
3. Two local clusters run side by side — ``single`` (one node) and ``mesh`` (``--nodes``
   nodes; clients talk to node 0), every node with ``--threads-per-node`` — and each
   tool runs against one, then the other, the order alternating from run to run so both
   runs of a pair see the same machine load: lm-eval ``local-completions`` on ``rmcc_gen``
   (``tokenizer_backend=None``: text prompts), ``local-chat-completions`` on ``rmcc_gen``
   (``--apply_chat_template``: the few-shot rows become chat turns), ``local-completions`` on
   ``rmcc_loglik`` (the tokenizer is the model directory: token-id prompts with ``echo`` +
   ``logprobs``), then a guidellm sweep on ``/v1/completions`` with synthetic prompts that
   share ``--guidellm-prefix-count`` prefixes. Every lm-eval run writes ``--log_samples``;
   temperature is 0 (the tasks say so).
4. The per-sample outputs of the same lm-eval run against both targets are compared sample by
   sample (doc id, the answers the harness parsed, the metric): routing must never change an
   answer. The table, the times (the harness's request phase — its "Requesting API" bar — and
   each lm-eval process's wall time, the load average around it), cache-hit tokens from the
   nodes' ``/metrics``, and guidellm's throughput / TTFT / ITL are printed and written to
   ``summary.json`` / ``summary.md``.

The check program runs in the project's venv; lm-eval and guidellm run in their own venv
(``--clients-venv``, built by ``make clients-check``) as subprocesses. Exit status: 0 when every
tool run completed and every compared sample is identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixmesh.workload.mmlu import Question

DEFAULT_SUBJECTS = ("abstract_algebra", "anatomy", "management", "world_religions")
TARGETS = ("single", "mesh")
LL_TAG, GEN_TAG = "rmcc_loglik", "rmcc_gen"
LETTERS = ("A", "B", "C", "D")
# (run name, lm-eval model, task tag): the order every target runs them in
LM_RUNS = (
    ("completions-generate", "local-completions", GEN_TAG),
    ("chat-generate", "local-chat-completions", GEN_TAG),
    ("completions-loglikelihood", "local-completions", LL_TAG),
)
LOGPROB_TOLERANCE = 1e-4  # |Δ log-likelihood| still called the same (fp32 reduction order)


# ------------------------------------------------------------------------------ data + tasks
def _row(q: Question, subject: str) -> dict[str, Any]:
    return {"question": q.text, "choices": list(q.choices), "answer": LETTERS.index(q.answer),
            "subject": subject}


def write_subset(mmlu_dir: Path, subjects: Sequence[str], questions: int, dest: Path
                 ) -> dict[str, dict[str, Path]]:
    """Copy the dev rows and the first ``questions`` test rows of each subject as JSONL."""
    from radixmesh.workload.mmlu import load_subjects

    try:
        by_name = {s.name: s for s in load_subjects(mmlu_dir, "test")}
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"error: --mmlu-dir {mmlu_dir}: {exc}") from exc
    missing = [s for s in subjects if s not in by_name]
    if missing:
        raise SystemExit(f"error: no MMLU subject {', '.join(missing)} under {mmlu_dir}")
    dest.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, Path]] = {}
    for name in subjects:
        subject = by_name[name]
        files[name] = {}
        for split, rows in (("dev", subject.dev), ("test", subject.test[:questions])):
            out = dest / f"{name}_{split}.jsonl"
            out.write_text("".join(json.dumps(_row(q, name)) + "\n" for q in rows),
                           encoding="utf-8")
            files[name][split] = out
    return files


def corpus(files: Mapping[str, Mapping[str, Path]]) -> Iterator[str]:
    """The text the run's tokenizer is trained on: every header, question and choice."""
    for subject, splits in files.items():
        yield header(subject)
        for path in splits.values():
            for line in path.read_text(encoding="utf-8").splitlines():
                row = json.loads(line)
                yield row["question"] + "\n" + "\n".join(row["choices"]) + "\nAnswer: A B C D"


def header(subject: str) -> str:
    return ("The following are multiple choice questions (with answers) about "
            f"{subject.replace('_', ' ')}.\n\n")


_DOC_TO_TEXT = ("{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\n"
                "C. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:")


def task_configs(subject: str, files: Mapping[str, Path]) -> dict[str, dict[str, Any]]:
    """The two lm-eval tasks of one subject: loglikelihood and generate-until, 5-shot."""
    common: dict[str, Any] = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {s: str(p) for s, p in files.items()}},
        "test_split": "test",
        "fewshot_split": "dev",
        "fewshot_config": {"sampler": "first_n"},
        "num_fewshot": 5,
        "description": header(subject),
        "doc_to_text": _DOC_TO_TEXT,
        "target_delimiter": " ",
        "fewshot_delimiter": "\n\n",
        "metadata": {"version": 1.0},
    }
    loglik = {**common, "task": f"{LL_TAG}_{subject}", "tag": LL_TAG,
              "output_type": "multiple_choice", "doc_to_choice": list(LETTERS),
              "doc_to_target": "answer",
              "metric_list": [{"metric": "acc", "aggregation": "mean",
                               "higher_is_better": True}]}
    gen = {**common, "task": f"{GEN_TAG}_{subject}", "tag": GEN_TAG,
           "output_type": "generate_until",
           "doc_to_target": "{{['A', 'B', 'C', 'D'][answer]}}",
           "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4, "do_sample": False,
                                 "temperature": 0.0},
           "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                            "higher_is_better": True, "ignore_case": True,
                            "ignore_punctuation": True}]}
    return {loglik["task"]: loglik, gen["task"]: gen}


def write_tasks(files: Mapping[str, Mapping[str, Path]], dest: Path) -> list[str]:
    """Write every task as ``<task>.yaml`` (JSON is YAML); returns the task names."""
    dest.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    for subject, splits in files.items():
        for name, cfg in task_configs(subject, splits).items():
            (dest / f"{name}.yaml").write_text(json.dumps(cfg, indent=2) + "\n",
                                               encoding="utf-8")
            names.append(name)
    return names


def build_model(dest: Path, files: Mapping[str, Mapping[str, Path]], vocab: int) -> Path:
    """A ``tiny`` random-weight model directory whose BPE is trained on the subset."""
    from radixmesh.engine.testing import save_random_model_dir

    if not (dest / "tokenizer.json").is_file():
        save_random_model_dir(dest, "tiny", seed=0, vocab_size=vocab, corpus=corpus(files))
    return dest


# ------------------------------------------------------------------------------ the tools
def tool_env(run_dir: Path) -> dict[str, str]:
    """The tools' environment: offline, caches inside the run folder, no proxy for loopback."""
    env = dict(os.environ)
    home = run_dir / "hf-home"
    env.update({
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(home), "HF_DATASETS_CACHE": str(home / "datasets"),
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
        "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
        # tqdm reads TQDM_* as its defaults: rate = n / elapsed (not a moving average), so the
        # harness's own "Requesting API" bar gives the request phase's duration exactly
        "TQDM_SMOOTHING": "0",
    })
    return env


def lm_eval_argv(bin_dir: Path, model: str, url: str, model_name: str, model_dir: Path,
                 tag: str, tasks_dir: Path, out: Path, concurrency: int,
                 limit: int | None = None) -> list[str]:
    """The exact ``lm_eval run`` command of one run."""
    endpoint = "chat/completions" if model == "local-chat-completions" else "completions"
    args = [f"base_url={url}/v1/{endpoint}", f"model={model_name}",
            f"num_concurrent={concurrency}", "timeout=600"]
    if tag == LL_TAG:  # context lengths need the tokenizer: the model directory's own
        args += ["tokenizer_backend=huggingface", f"tokenizer={model_dir}", "max_length=4096"]
    else:
        args += ["tokenizer_backend=None"]
    argv = [str(bin_dir / "lm_eval"), "run", "--model", model, "--model_args", ",".join(args),
            "--tasks", tag, "--include_path", str(tasks_dir), "--log_samples",
            "--output_path", str(out), "--seed", "1234"]
    if model == "local-chat-completions":
        argv.append("--apply_chat_template")
    if limit is not None:
        argv += ["--limit", str(limit)]
    return argv


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


def run_tool(argv: Sequence[str], log: Path, env: Mapping[str, str], timeout: float,
             cwd: Path) -> tuple[int, float]:
    """Run one tool to completion (bounded), output to ``log``; (exit status, wall seconds)."""
    start = time.monotonic()
    with log.open("wb") as fh:
        fh.write(("$ " + " ".join(argv) + "\n").encode())
        fh.flush()
        try:
            proc = subprocess.run(list(argv), stdout=fh, stderr=subprocess.STDOUT, env=dict(env),
                                  cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL,
                                  check=False)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            fh.write(f"\n[clients-check] timed out after {timeout:.0f}s\n".encode())
            rc = 124
    return rc, time.monotonic() - start


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
def guidellm_scenario(url: str, model_name: str, model_dir: Path, out_json: Path,
                      args: argparse.Namespace) -> dict[str, Any]:
    """A guidellm scenario: a sweep on /v1/completions with synthetic, prefix-sharing prompts."""
    return {
        "metadata": {"name": "radixmesh-clients-check"},
        "spec": {
            "backend": {"kind": "openai_http", "target": url, "model": model_name,
                        "request_format": "/v1/completions"},
            "profile": {"kind": "sweep", "sweep_size": args.guidellm_sweep,
                        "max_concurrency": args.guidellm_max_concurrency},
            "data": [{"kind": "synthetic_text", "prompt_tokens": args.guidellm_prompt_tokens,
                      "output_tokens": args.guidellm_output_tokens,
                      "prefix_tokens": args.guidellm_prefix_tokens,
                      "prefix_count": args.guidellm_prefix_count}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(model_dir)},
            "constraints": [{"kind": "max_duration", "seconds": args.guidellm_seconds}],
            "seed": {"kind": "static", "value": 42},
            "outputs": [{"kind": "json", "path": str(out_json)}],
        },
    }


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


# ------------------------------------------------------------------------------ the nodes
_ROUTE = re.compile(r'^radixmesh_requests_total\{route="(\w+)"\}$')


def node_counters(urls: Iterable[str]) -> dict[str, float]:
    """Prompt tokens, cache-hit tokens and requests by route, summed over the nodes."""
    import httpx

    from radixmesh.runtime.metrics import parse_samples, sample_sum

    total: dict[str, float] = {}
    for url in urls:
        try:
            text = httpx.get(url + "/metrics", timeout=5.0, trust_env=False).text
        except httpx.HTTPError:
            continue
        samples = parse_samples(text)
        for name in ("prompt_tokens", "cache_hit_tokens"):
            total[name] = total.get(name, 0.0) + sample_sum(samples, f"radixmesh_{name}_total")
        for key, value in samples.items():
            if m := _ROUTE.match(key):
                total[f"route_{m.group(1)}"] = total.get(f"route_{m.group(1)}", 0.0) + value
    return total


def delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def warm_up(urls: Iterable[str], model_name: str) -> None:
    """One short request to each node directly: the first forward pass of a fresh process
    (lazy initialisation) is not charged to whichever tool runs first."""
    import httpx

    body = {"model": model_name, "prompt": "warm-up: not an MMLU question", "max_tokens": 2,
            "temperature": 0}
    for url in urls:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(url + "/v1/completions", json=body, timeout=60.0, trust_env=False)


def serve_options(model_dir: Path, threads: int, max_queue_wait: float) -> dict[str, object]:
    """Every node's ``radixmesh serve`` options. ``max_queue_wait``: lm-eval sends
    ``num_concurrent`` requests at once and does not wait for ``Retry-After`` (its retries
    back off 1-10 s, 3 tries), so a node on a busy machine must not answer 429 here."""
    return {"model": str(model_dir), "policy": "cost", "gossip_interval": 0.2,
            "threads": threads, "log_level": "warning", "max_queue_wait": max_queue_wait}


# ------------------------------------------------------------------------------ one target
@dataclass
class TargetResult:
    target: str
    nodes: int
    runs: list[ToolRun] = field(default_factory=list)
    counters: dict[str, dict[str, float]] = field(default_factory=dict)  # per run
    guidellm: list[GuideRow] = field(default_factory=list)
    guidellm_run: ToolRun | None = None


def run_all(ctx: Context) -> dict[str, TargetResult]:
    """Both targets up at once; each tool runs against one, then the other, the order
    alternating from run to run (single, mesh; mesh, single; ...), so the two runs of a pair
    see the same machine load (this machine is shared and noisy) and drift cancels out."""
    from radixmesh.runtime.cluster import LocalCluster

    sizes = {"single": 1, "mesh": ctx.args.nodes}
    results = {t: TargetResult(t, n) for t, n in sizes.items()}
    with contextlib.ExitStack() as stack:
        clusters = {}
        for target, nodes in sizes.items():
            print(f"== {target}: starting {nodes} node(s) ...", flush=True)
            opts = serve_options(ctx.model_dir, ctx.args.threads_per_node,
                                 ctx.args.max_queue_wait)
            clusters[target] = stack.enter_context(LocalCluster(
                nodes, opts, log_dir=ctx.run_dir / "nodes" / target, ready_timeout=300.0))
            warm_up(clusters[target].urls, ctx.model_dir.name)
        runs = [r for r in LM_RUNS if r[0] not in ctx.args.skip]
        steps: list[tuple[str, str, str] | None] = [*runs]
        if "guidellm" not in ctx.args.skip:
            steps.append(None)
        for i, step in enumerate(steps):
            for target in (TARGETS if i % 2 == 0 else TARGETS[::-1]):
                run_step(ctx, step, results[target], clusters[target].urls)
    return results


def run_step(ctx: Context, step: tuple[str, str, str] | None, result: TargetResult,
             urls: Sequence[str]) -> None:
    """One lm-eval run (``step``) or the guidellm sweep (None) against one target's node 0."""
    if step is None:
        result.guidellm_run, result.guidellm = guidellm_run(ctx, result.target, urls[0])
        return
    name, model, tag = step
    before = node_counters(urls)
    result.runs.append(lm_eval_run(ctx, result.target, name, model, tag, urls[0]))
    result.counters[name] = delta(node_counters(urls), before)


def execute(ctx: Context, run: ToolRun, cwd: Path) -> None:
    """Run ``run.argv`` (bounded); its status, wall time and the machine's load around it."""
    before = os.getloadavg()[0]
    run.rc, run.wall_s = run_tool(run.argv, Path(run.log), ctx.env, ctx.args.tool_timeout, cwd)
    run.load = (before, os.getloadavg()[0])


def lm_eval_run(ctx: Context, target: str, name: str, model: str, tag: str, url: str
                ) -> ToolRun:
    out = ctx.run_dir / "lm-eval" / target / name
    limit = ctx.args.loglik_questions if tag == LL_TAG else None
    argv = lm_eval_argv(ctx.bin_dir, model, url, ctx.model_dir.name, ctx.model_dir, tag,
                        ctx.tasks_dir, out, ctx.args.concurrency, limit)
    run = ToolRun(name, target, argv, log=str(out.with_suffix(".log")))
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"   {target}: lm-eval {name} ...", end=" ", flush=True)
    execute(ctx, run, ctx.run_dir)
    run.samples, run.eval_s = load_samples(out), eval_seconds(out)
    run.request_s = request_seconds(Path(run.log))
    if run.rc != 0 or not run.samples:
        run.failures = harness_failures(Path(run.log)) or [f"exit status {run.rc}"]
    print(f"rc {run.rc}, {len(run.samples)} samples, {run.wall_s:.1f}s (log {run.log})",
          flush=True)
    return run


def guidellm_run(ctx: Context, target: str, url: str) -> tuple[ToolRun, list[GuideRow]]:
    folder = ctx.run_dir / "guidellm" / target
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / "benchmarks.json"
    scenario = folder / "scenario.json"
    scenario.write_text(json.dumps(guidellm_scenario(url, ctx.model_dir.name, ctx.model_dir,
                                                     report, ctx.args), indent=2) + "\n",
                        encoding="utf-8")
    argv = [str(ctx.bin_dir / "guidellm"), "run", "--scenario", str(scenario),
            "--disable-console-interactive"]
    run = ToolRun("guidellm", target, argv, log=str(folder / "guidellm.log"))
    print(f"   {target}: guidellm sweep ...", end=" ", flush=True)
    execute(ctx, run, folder)
    rows = guidellm_rows(target, report) if report.is_file() else []
    if run.rc != 0 or not rows:
        run.failures = harness_failures(Path(run.log)) or [f"exit status {run.rc}"]
    elif not any(r.ok for r in rows):
        run.failures = ["no request completed"]
    print(f"rc {run.rc}, {len(rows)} benchmarks, {run.wall_s:.1f}s (log {run.log})", flush=True)
    return run, rows


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


def write_summary(ctx: Context, results: Mapping[str, TargetResult],
                  comparisons: Sequence[Comparison], md: Sequence[str]) -> None:
    data = {
        "command": ctx.command,
        "targets": {t: {"nodes": r.nodes,
                        "lm_eval": [{k: v for k, v in asdict(run).items() if k != "samples"}
                                    | {"samples": len(run.samples)} for run in r.runs],
                        "counters": r.counters,
                        "guidellm": [asdict(g) for g in r.guidellm]}
                    for t, r in results.items()},
        "comparisons": [asdict(c) | {"ok": c.ok} for c in comparisons],
    }
    (ctx.run_dir / "summary.json").write_text(json.dumps(data, indent=2) + "\n",
                                              encoding="utf-8")
    (ctx.run_dir / "summary.md").write_text("\n".join(md) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------ main
@dataclass
class Context:
    args: argparse.Namespace
    run_dir: Path
    bin_dir: Path
    model_dir: Path
    tasks_dir: Path
    env: dict[str, str]
    command: str
    load_at_start: float = field(default_factory=lambda: os.getloadavg()[0])


def prepare(args: argparse.Namespace) -> Context:
    run_dir = args.out.resolve()
    bin_dir = (args.clients_venv / "bin").resolve()
    for tool in ("lm_eval", "guidellm"):
        if not (bin_dir / tool).exists():
            raise SystemExit(f"error: {bin_dir / tool} not found: build the clients' venv "
                             "first (make clients-check does)")
    files = write_subset(args.mmlu_dir, args.subjects, args.questions, run_dir / "data")
    tasks_dir = run_dir / "tasks"
    write_tasks(files, tasks_dir)
    model_dir = build_model(run_dir / "model", files, args.vocab_size)
    return Context(args, run_dir, bin_dir, model_dir, tasks_dir, tool_env(run_dir),
                   " ".join(["python -m radixmesh.bench.clients_check", *sys.argv[1:]]))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m radixmesh.bench.clients_check",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mmlu-dir", type=Path, required=True,
                   help="MMLU in its release layout ({dev,test}/SUBJECT_SPLIT.csv)")
    p.add_argument("--out", type=Path, default=Path("runs/clients"), help="run folder")
    p.add_argument("--clients-venv", type=Path, default=Path(".venv-clients"),
                   help="virtual environment with lm-eval and guidellm")
    p.add_argument("--nodes", type=int, default=4, help="nodes in the mesh")
    p.add_argument("--subjects", type=lambda s: tuple(s.split(",")),
                   default=DEFAULT_SUBJECTS, help="comma-separated MMLU subjects")
    p.add_argument("--questions", type=int, default=10, help="test questions per subject")
    p.add_argument("--loglik-questions", type=int, default=3,
                   help="questions per subject in the loglikelihood run (4 requests each; an "
                   "echo + logprobs request computes its whole prompt, no prefix reuse)")
    p.add_argument("--vocab-size", type=int, default=8000, help="BPE vocabulary of the model")
    p.add_argument("--concurrency", type=int, default=4, help="lm-eval num_concurrent")
    p.add_argument("--threads-per-node", type=int, default=1,
                   help="torch threads of every node, the single one included (one node vs N "
                   "such nodes; >1 thread per node on a shared, oversubscribed machine makes "
                   "the engine several times slower)")
    p.add_argument("--skip", type=lambda s: tuple(x for x in s.split(",") if x), default=(),
                   help="runs to leave out: " + ", ".join(r[0] for r in LM_RUNS) + ", guidellm")
    p.add_argument("--max-queue-wait", type=float, default=600.0,
                   help="the nodes' --max-queue-wait (seconds of queued work before a 429)")
    p.add_argument("--tool-timeout", type=float, default=900.0, help="seconds per tool run")
    p.add_argument("--guidellm-sweep", type=int, default=4,
                   help="sweep size (synchronous, throughput, then constant rates between)")
    p.add_argument("--guidellm-seconds", type=float, default=20.0, help="seconds per rate")
    p.add_argument("--guidellm-max-concurrency", type=int, default=4)
    p.add_argument("--guidellm-prompt-tokens", type=int, default=128,
                   help="tokens after the shared prefix")
    p.add_argument("--guidellm-prefix-tokens", type=int, default=256)
    p.add_argument("--guidellm-prefix-count", type=int, default=4,
                   help="distinct shared prefixes")
    p.add_argument("--guidellm-output-tokens", type=int, default=16)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    ctx = prepare(args)
    print(f"run folder {ctx.run_dir}; model {ctx.model_dir}; tasks {ctx.tasks_dir}", flush=True)
    results = run_all(ctx)
    comparisons = [compare(name, _samples(results["single"], name), _samples(results["mesh"],
                                                                             name))
                   for name, _, _ in LM_RUNS if name not in args.skip]
    md = report_lines(ctx, results, comparisons)
    print("\n" + "\n".join(md), flush=True)
    write_summary(ctx, results, comparisons, md)
    ok = all(c.ok for c in comparisons) and not failures_text(results)
    print(f"\nclients-check {'PASSED' if ok else 'FAILED'} (summary in "
          f"{ctx.run_dir / 'summary.md'})", flush=True)
    return 0 if ok else 1


def _samples(result: TargetResult, name: str) -> dict[str, dict[str, Any]]:
    run = _run(result, name)
    return run.samples if run else {}


def report_lines(ctx: Context, results: Mapping[str, TargetResult],
                 comparisons: Sequence[Comparison]) -> list[str]:
    md = [f"command: `{ctx.command}`", "",
          f"lm-eval: single node vs {results['mesh'].nodes}-node mesh (entry node 0), "
          f"subjects {', '.join(ctx.args.subjects)}, {ctx.args.questions} questions each, "
          f"5-shot, num_concurrent={ctx.args.concurrency}, {ctx.args.threads_per_node} torch "
          f"thread(s) per node, machine load average at start {ctx.load_at_start:.1f}", "",
          *lm_eval_table(results, comparisons)]
    for c in comparisons:
        md += [f"- {c.run}: {c.diffs[i]}" for i in range(len(c.diffs))]
        if c.only_one_side:
            md.append(f"- {c.run}: {c.only_one_side} samples only on one side")
    rows = [g for r in results.values() for g in r.guidellm]
    if rows:
        md += ["", "guidellm sweep on /v1/completions (synthetic prompts: "
               f"{ctx.args.guidellm_prefix_count} shared prefixes of "
               f"{ctx.args.guidellm_prefix_tokens} tokens + {ctx.args.guidellm_prompt_tokens}, "
               f"{ctx.args.guidellm_output_tokens} output tokens, "
               f"{ctx.args.guidellm_seconds:.0f}s per rate)", "", *guidellm_table(rows)]
    failed = failures_text(results)
    if failed:
        md += ["", "failures:", *failed]
    return md


if __name__ == "__main__":
    raise SystemExit(main())
