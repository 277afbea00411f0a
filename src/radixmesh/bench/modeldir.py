"""Build a random-weight model directory whose tokenizer is a BPE trained on the MMLU text.

The built-in presets tokenize bytes: a 5-shot MMLU prompt is ~1,900 byte tokens, where the
paper's Qwen2.5 tokenizer gives ~540. For figures whose absolute times mean something, the
model directory written here pairs a preset's architecture (random weights) with a byte-level
BPE trained on this machine on the MMLU questions themselves, so prompts have a realistic
token count. Nothing is downloaded.

    python -m radixmesh.bench.modeldir --mmlu-dir $MMLU --preset qwen2.5-0.5b \\
        --vocab-size 32000 --out models/qwen-mmlu

prints the directory, the vocabulary and the mean / median prompt length in tokens of the
MMLU test prompts (what ``radixmesh bench --mmlu-dir`` sends), also written to
``prompt_tokens.json`` in the directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path

from radixmesh.workload.mmlu import format_question, header, load_groups, load_subjects


def mmlu_corpus(mmlu_dir: Path) -> Iterator[str]:
    """Every subject header and question (dev, val and test splits), each once."""
    for split in ("dev", "val", "test"):
        try:
            subjects = load_subjects(mmlu_dir, split)
        except FileNotFoundError:
            continue
        for s in subjects:
            yield header(s.name)
            for q in s.test:
                yield format_question(q, with_answer=True)


def prompt_token_stats(model_dir: Path, mmlu_dir: Path) -> dict[str, float]:
    """Token counts of the MMLU test prompts under the directory's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = [r.prompt for reqs in load_groups(mmlu_dir).values() for r in reqs]
    lengths = [len(e.ids) for e in tok.encode_batch(texts)]
    chars = [len(t) for t in texts]
    return {
        "prompts": len(lengths),
        "mean_tokens": statistics.fmean(lengths),
        "median_tokens": statistics.median(lengths),
        "max_tokens": max(lengths),
        "mean_chars": statistics.fmean(chars),
    }


def build(out: Path, mmlu_dir: Path, preset: str, vocab_size: int, seed: int) -> dict[str, object]:
    from radixmesh.engine.testing import save_random_model_dir

    if not (mmlu_dir / "dev").is_dir():
        raise SystemExit(f"error: {mmlu_dir} is not an MMLU release folder (no dev/)")
    save_random_model_dir(out, preset, seed, vocab_size, corpus=mmlu_corpus(mmlu_dir))
    stats = prompt_token_stats(out, mmlu_dir)
    info: dict[str, object] = {
        "model_dir": str(out), "preset": preset, "vocab_size": vocab_size, "seed": seed, **stats,
    }
    (out / "prompt_tokens.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m radixmesh.bench.modeldir", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mmlu-dir", required=True, type=Path, help="MMLU in its release layout")
    p.add_argument("--out", required=True, type=Path, help="model directory to write")
    p.add_argument("--preset", default="qwen2.5-0.5b", help="architecture (random weights)")
    p.add_argument("--vocab-size", type=int, default=32_000, help="BPE vocabulary size")
    p.add_argument("--seed", type=int, default=0, help="weight seed")
    args = p.parse_args(argv)
    info = build(args.out, args.mmlu_dir, args.preset, args.vocab_size, args.seed)
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
