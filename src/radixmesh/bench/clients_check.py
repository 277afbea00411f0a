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

Three modules: steps 1 and 2, and the tools' command lines, are ``bench/clients_tasks.py``'s;
step 4's comparison and tables ``bench/clients_results.py``'s; this one runs the clusters and
the tools (step 3) and writes the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from radixmesh.bench.clients_results import (
    TARGETS,
    Comparison,
    GuideRow,
    TargetResult,
    ToolRun,
    compare,
    eval_seconds,
    failures_text,
    guidellm_rows,
    guidellm_table,
    harness_failures,
    lm_eval_table,
    load_samples,
    request_seconds,
    samples_of,
)
from radixmesh.bench.clients_tasks import (
    GEN_TAG,
    LL_TAG,
    build_model,
    guidellm_scenario,
    lm_eval_argv,
    tool_env,
    write_subset,
    write_tasks,
)

DEFAULT_SUBJECTS = ("abstract_algebra", "anatomy", "management", "world_religions")
# (run name, lm-eval model, task tag): the order every target runs them in
LM_RUNS = (
    ("completions-generate", "local-completions", GEN_TAG),
    ("chat-generate", "local-chat-completions", GEN_TAG),
    ("completions-loglikelihood", "local-completions", LL_TAG),
)


# ------------------------------------------------------------------------------ the tools
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
    comparisons = [compare(name, samples_of(results["single"], name),
                           samples_of(results["mesh"], name))
                   for name, _, _ in LM_RUNS if name not in args.skip]
    md = report_lines(ctx, results, comparisons)
    print("\n" + "\n".join(md), flush=True)
    write_summary(ctx, results, comparisons, md)
    ok = all(c.ok for c in comparisons) and not failures_text(results)
    print(f"\nclients-check {'PASSED' if ok else 'FAILED'} (summary in "
          f"{ctx.run_dir / 'summary.md'})", flush=True)
    return 0 if ok else 1




# ------------------------------------------------------------------------------ report
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
