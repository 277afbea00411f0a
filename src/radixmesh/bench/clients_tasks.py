"""``make clients-check``'s inputs: a small MMLU subset, the lm-eval task files that read it,
a random-weight model whose tokenizer is trained on it (``bench/clients_check.py``'s steps 1 and
2), and the tools' command lines.

Theory of operation
-------------------
:func:`write_subset` copies, per subject, the 5 dev rows (the few-shot set) and the first
``questions`` test rows as JSON-lines files; :func:`write_tasks` writes two lm-eval tasks per
subject (JSON is YAML) reading them with the ``json`` dataset builder: a loglikelihood task
(``multiple_choice``, tag :data:`LL_TAG`) and a ``generate_until`` task (tag :data:`GEN_TAG`),
both in MMLU's 5-shot format (header + the same 5 dev rows first), so the few-shot prefix
repeats for every question of a subject. :func:`build_model` trains the model directory's BPE
on :func:`corpus` (every header, question and choice), so the harness, guidellm and the nodes
load the very same tokenizer from a local path. :func:`lm_eval_argv` is one lm-eval run's
exact command, :func:`guidellm_scenario` the guidellm sweep, :func:`tool_env` the environment
both run in (offline, caches inside the run folder).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixmesh.workload.mmlu import Question

LL_TAG, GEN_TAG = "rmcc_loglik", "rmcc_gen"
LETTERS = ("A", "B", "C", "D")


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
