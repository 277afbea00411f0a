"""Build the default preset's BPE tokenizer (``engine/bpe.py`` says what and why).

::

    python -m radixmesh.bench.default_bpe [--docs docs] [--out src/radixmesh/engine/bpe8k]

The corpus ships with the package: its own Python sources, its Markdown docs (when ``--docs``
exists) and 200,000 characters of seeded pseudo-words (``workload.synthetic.words``). The
result is deterministic for one tree and one ``tokenizers`` release; rebuild only to change the
vocabulary (every node of a mesh must then be updated together: the fingerprint changes).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from radixmesh.engine.bpe import DIRECTORY, VOCAB_SIZE
from radixmesh.engine.testing import train_tokenizer
from radixmesh.engine.tokenizers import CHATML_FALLBACK, HFTokenizer
from radixmesh.workload.synthetic import words

PSEUDO_WORD_CHARS = 200_000


def corpus(docs: Path | None) -> Iterator[str]:
    """The training text: package sources, docs, seeded pseudo-words."""
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        yield path.read_text(encoding="utf-8")
    if docs is not None:
        for path in sorted(docs.glob("*.md")):
            yield path.read_text(encoding="utf-8")
    rng = random.Random(0)
    for _ in range(PSEUDO_WORD_CHARS // 1000):
        yield words(rng, 1000)


def build(out: Path, docs: Path | None, vocab_size: int = VOCAB_SIZE) -> None:
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(vocab_size, corpus(docs)).save(str(out / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "chat_template": CHATML_FALLBACK,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                               encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m radixmesh.bench.default_bpe",
                                description="build the default preset's BPE tokenizer")
    p.add_argument("--docs", type=Path, default=Path("docs"), help="Markdown docs to add")
    p.add_argument("--out", type=Path, default=DIRECTORY)
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = p.parse_args(argv)
    build(args.out, args.docs if args.docs.is_dir() else None, args.vocab_size)
    tok = HFTokenizer(args.out)
    print(f"wrote {args.out} (vocab {tok.vocab_size}, fingerprint {tok.fingerprint})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
