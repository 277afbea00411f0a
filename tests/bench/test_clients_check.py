"""The pure parts of ``make clients-check`` (radixmesh.bench.clients_*): the local MMLU
subset and lm-eval task files, the per-sample comparison of two runs, and reading the tools'
outputs (lm-eval's progress bar, guidellm's report). The tools themselves are not installed
here; ``make clients-check`` runs them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from radixmesh.bench.clients_results import (
    compare,
    guidellm_rows,
    load_samples,
    request_seconds,
)
from radixmesh.bench.clients_tasks import GEN_TAG, LL_TAG, lm_eval_argv, write_subset, write_tasks


def _mmlu(root: Path, subjects: dict[str, int]) -> Path:
    for split in ("dev", "test"):
        (root / split).mkdir(parents=True)
    for name, n_test in subjects.items():
        for split, n in (("dev", 5), ("test", n_test)):
            rows = [f'"{name} {split} q{i}?",a{i},b{i},c{i},d{i},{"ABCD"[i % 4]}'
                    for i in range(n)]
            (root / split / f"{name}_{split}.csv").write_text("\n".join(rows) + "\n")
    return root


def test_subset_and_tasks(tmp_path: Path) -> None:
    mmlu = _mmlu(tmp_path / "mmlu", {"anatomy": 7, "virology": 3})
    files = write_subset(mmlu, ["anatomy", "virology"], 4, tmp_path / "data")
    test_rows = [json.loads(x) for x in files["anatomy"]["test"].read_text().splitlines()]
    assert len(test_rows) == 4 and test_rows[1] == {
        "question": "anatomy test q1?", "choices": ["a1", "b1", "c1", "d1"], "answer": 1,
        "subject": "anatomy"}
    assert len(files["virology"]["test"].read_text().splitlines()) == 3  # fewer than asked
    assert len(files["anatomy"]["dev"].read_text().splitlines()) == 5
    names = write_tasks(files, tmp_path / "tasks")
    assert sorted(names) == sorted(f"{t}_{s}" for t in (LL_TAG, GEN_TAG)
                                   for s in ("anatomy", "virology"))
    ll = json.loads((tmp_path / "tasks" / f"{LL_TAG}_anatomy.yaml").read_text())
    gen = json.loads((tmp_path / "tasks" / f"{GEN_TAG}_anatomy.yaml").read_text())
    for task in (ll, gen):  # MMLU's 5-shot: the same header and dev rows before every question
        assert task["num_fewshot"] == 5 and task["fewshot_config"] == {"sampler": "first_n"}
        assert task["description"].startswith("The following are multiple choice questions")
        assert task["dataset_kwargs"]["data_files"]["test"] == str(files["anatomy"]["test"])
    assert ll["output_type"] == "multiple_choice" and ll["doc_to_choice"] == list("ABCD")
    assert gen["output_type"] == "generate_until"
    assert gen["generation_kwargs"]["temperature"] == 0.0


def test_unknown_subject_is_an_error(tmp_path: Path) -> None:
    mmlu = _mmlu(tmp_path / "mmlu", {"anatomy": 2})
    with pytest.raises(SystemExit, match="no MMLU subject virology"):
        write_subset(mmlu, ["virology"], 2, tmp_path / "data")


def test_lm_eval_argv_by_kind(tmp_path: Path) -> None:
    gen = lm_eval_argv(tmp_path, "local-completions", "http://h:1", "m", tmp_path / "md",
                       GEN_TAG, tmp_path / "t", tmp_path / "o", 4)
    args = gen[gen.index("--model_args") + 1]
    assert "base_url=http://h:1/v1/completions" in args and "tokenizer_backend=None" in args
    assert "--log_samples" in gen and "--apply_chat_template" not in gen
    ll = lm_eval_argv(tmp_path, "local-completions", "http://h:1", "m", tmp_path / "md",
                      LL_TAG, tmp_path / "t", tmp_path / "o", 4, limit=3)
    args = ll[ll.index("--model_args") + 1]
    assert f"tokenizer={tmp_path / 'md'}" in args and "tokenizer_backend=huggingface" in args
    assert ll[ll.index("--limit") + 1] == "3"
    chat = lm_eval_argv(tmp_path, "local-chat-completions", "http://h:1", "m", tmp_path,
                        GEN_TAG, tmp_path, tmp_path, 1)
    assert "base_url=http://h:1/v1/chat/completions" in chat[chat.index("--model_args") + 1]
    assert "--apply_chat_template" in chat


def _ll(doc: int, lps: list[float], acc: float = 0.0) -> dict[str, Any]:
    resps = [[[str(x), "False"]] for x in lps]  # how --log_samples writes them: strings
    return {"doc_id": doc, "resps": resps, "filtered_resps": [r[0] for r in resps], "acc": acc}


def _gen(doc: int, text: str, em: float = 0.0) -> dict[str, Any]:
    return {"doc_id": doc, "resps": [[text]], "filtered_resps": [text], "exact_match": em}


def test_compare_generations() -> None:
    a = {"t/0": _gen(0, " B"), "t/1": _gen(1, " C")}
    assert compare("gen", a, dict(a)).ok
    b = {"t/0": _gen(0, " B"), "t/1": _gen(1, " D")}
    c = compare("gen", a, b)
    assert not c.ok and (c.samples, c.identical) == (2, 1) and "t/1" in c.diffs[0]
    missing = compare("gen", a, {"t/0": _gen(0, " B")})
    assert not missing.ok and missing.only_one_side == 1
    assert not compare("gen", {}, {}).ok  # nothing compared is no pass


def test_compare_loglikelihoods() -> None:
    a = {"t/0": _ll(0, [-1.0, -2.0, -3.0, -4.0])}
    close = {"t/0": _ll(0, [-1.00001, -2.0, -3.0, -4.0])}
    c = compare("ll", a, close)
    assert c.ok and 0 < c.max_logprob_diff < 1e-4
    far = compare("ll", a, {"t/0": _ll(0, [-1.1, -2.0, -3.0, -4.0])})
    assert not far.ok and far.max_logprob_diff == pytest.approx(0.1)
    flipped = compare("ll", a, {"t/0": _ll(0, [-2.0, -1.0, -3.0, -4.0])})
    assert not flipped.ok


def test_load_samples(tmp_path: Path) -> None:
    folder = tmp_path / "out" / "model"
    folder.mkdir(parents=True)
    lines = [json.dumps(_gen(i, "x")) for i in range(3)]
    (folder / "samples_rmcc_gen_anatomy_2026-12-01T12-00-00.jsonl").write_text(
        "\n".join(lines) + "\n")
    assert sorted(load_samples(tmp_path / "out")) == [f"rmcc_gen_anatomy/{i}" for i in range(3)]


def test_request_seconds(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text("Requesting API:  50%|#    | 20/40 [00:10<00:10,  2.00it/s]"
                   "Requesting API: 100%|#####| 40/40 [00:16<00:00,  2.50it/s]\n")
    assert request_seconds(log) == pytest.approx(16.0)
    log.write_text("Requesting API: 100%|#####| 6/6 [00:21<00:00,  3.50s/it]\n")
    assert request_seconds(log) == pytest.approx(21.0)
    log.write_text("no bar here\n")
    assert request_seconds(log) is None


def test_guidellm_rows(tmp_path: Path) -> None:
    def dist(mean: float, p50: float, p95: float) -> dict[str, Any]:
        return {"successful": {"mean": mean, "percentiles": {"p50": p50, "p95": p95}}}

    bench = {
        "config": {"strategy": {"type_": "constant", "rate": 1.5}},
        "metrics": {"request_totals": {"successful": 9, "errored": 1, "incomplete": 2},
                    "requests_per_second": dist(1.4, 1.0, 2.0),
                    "output_tokens_per_second": dist(22.0, 20.0, 30.0),
                    "time_to_first_token_ms": dist(90.0, 80.0, 150.0),
                    "inter_token_latency_ms": dist(12.0, 11.0, 20.0)},
    }
    sync = {"config": {"strategy": {"type_": "synchronous"}}, "metrics": {}}
    report = tmp_path / "benchmarks.json"
    report.write_text(json.dumps({"benchmarks": [sync, bench]}))
    first, second = guidellm_rows("mesh", report)
    assert first.strategy == "synchronous" and first.ok == 0
    assert (second.strategy, second.ok, second.errored, second.incomplete) == (
        "constant@1.50/s", 9, 1, 2)
    assert (second.req_s, second.ttft_ms_p50, second.ttft_ms_p95, second.itl_ms_p50) == (
        1.4, 80.0, 150.0, 11.0)
