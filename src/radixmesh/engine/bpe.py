"""The default preset's tokenizer: a byte-level BPE of 8,192 ids, built offline, shipped.

Theory of operation
-------------------
A byte tokenizer spends ~4.9x the tokens of a BPE vocabulary on English text, so the default
model's context would hold a fifth of the prompts people send. The ``mini`` preset therefore
tokenizes with a byte-level BPE (lossless on any UTF-8 text, ChatML special tokens
``<|endoftext|>`` = EOS, ``<|im_start|>``, ``<|im_end|>``) trained with the ``tokenizers``
library by :func:`~radixmesh.engine.testing.train_tokenizer` on a corpus that ships with the
package: the package's own Python sources (English docstrings, code, JSON-like literals) and
its Markdown documentation, plus seeded pseudo-words (``workload.synthetic.words``, the text
of generated workloads). Nothing is downloaded and no dataset is needed.

The trained files live in ``engine/bpe8k/`` (``tokenizer.json`` + ``tokenizer_config.json``
with EOS and the ChatML template) and are loaded by :class:`~radixmesh.engine.tokenizers.
HFTokenizer` like any model directory's, so every peer gets the same ids (its fingerprint is
the file's digest). Rebuild them (only when the vocabulary should change: every node of a mesh
must then be updated together) with::

    python -m radixmesh.engine.bpe [--docs docs] [--out src/radixmesh/engine/bpe8k]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from radixmesh.engine.tokenizers import CHATML_FALLBACK, HFTokenizer

VOCAB_SIZE = 8192
DIRECTORY = Path(__file__).with_name("bpe8k")
PSEUDO_WORD_CHARS = 200_000


def corpus(docs: Path | None) -> Iterator[str]:
    """The training text: package sources, docs, seeded pseudo-words (module docstring)."""
    from radixmesh.workload.synthetic import words

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
    from radixmesh.engine.testing import train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(vocab_size, corpus(docs)).save(str(out / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "chat_template": CHATML_FALLBACK,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                               encoding="utf-8")


def load() -> HFTokenizer:
    """The shipped tokenizer."""
    return HFTokenizer(DIRECTORY)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m radixmesh.engine.bpe", description=__doc__)
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
