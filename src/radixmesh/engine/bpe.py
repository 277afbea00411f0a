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

    python -m radixmesh.bench.default_bpe [--docs docs] [--out src/radixmesh/engine/bpe8k]
"""

from __future__ import annotations

from pathlib import Path

from radixmesh.engine.tokenizers import HFTokenizer

VOCAB_SIZE = 8192
DIRECTORY = Path(__file__).with_name("bpe8k")


def load() -> HFTokenizer:
    """The shipped tokenizer."""
    return HFTokenizer(DIRECTORY)
