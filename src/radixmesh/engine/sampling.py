"""Per-request sampling for the built-in engine: penalties, temperature, top-p, seeds and
log-probabilities, applied to one sequence's logits row of a batched step.

Theory of operation
-------------------
A :class:`Sampler` is a request's sampling state: its ``torch.Generator`` (seeded by ``seed``,
or fresh entropy when ``seed`` is None; None when greedy) and, with penalties, the counts of
the tokens generated so far. ``next(raw)`` takes the row of raw logits restricted to the
tokenizer's vocabulary (a model's embedding matrix is often padded beyond it) and returns the
token and, when asked, its :class:`TokenLogprob`:

* log-probabilities: log_softmax of the *raw* logits (before penalties, temperature, top-p),
  the chosen token's and the ``k`` largest;
* presence / frequency penalties (OpenAI's, ``SamplingParams``), then greedy when
  ``temperature == 0`` (or below ``MIN_TEMPERATURE``: softmax(logits / T) overflows), otherwise
  softmax(logits / T) restricted to the smallest top-p nucleus, drawn from the generator.

Prompt log-probabilities (``score_prompt``) come from a plain forward over the whole prompt: a
cached prefix has no logits.

Each sequence's row is sampled on its own, so a batch's neighbours never change a request's
draw: a seeded request samples the same tokens batched or alone (given the same logits). The
one exception is plain greedy (no penalties, no log-probabilities), a pure function of its row:
the batch's plain-greedy rows take one argmax together (``greedy_rows``).
"""

from __future__ import annotations

import secrets

import torch
from transformers import DynamicCache, PreTrainedModel

from radixmesh.engine.base import SamplingParams, TokenLogprob

SCORE_CHUNK = 512  # prompt tokens per forward when scoring a prompt (bounds its logits)
MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (and softmax(logits / T) is NaN)


class Sampler:
    """One request's sampling state (module docstring)."""

    def __init__(self, sp: SamplingParams, vocab: int, device: torch.device) -> None:
        self.sp = sp
        self.gen: torch.Generator | None = None
        if sp.temperature >= MIN_TEMPERATURE:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(sp.seed if sp.seed is not None else secrets.randbits(63))
        self.counts = torch.zeros(vocab, device=device) if sp.penalized else None

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalties and no log-probabilities: the argmax of the raw row, so a
        batch's such rows can be picked at once (``greedy_rows``)."""
        return self.gen is None and self.counts is None and self.sp.logprobs is None

    def next(self, raw: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """The next token from a row of raw logits (the tokenizer's vocabulary)."""
        sp = self.sp
        entry = None
        logits = raw if self.counts is None else penalize(raw, self.counts, sp)
        if self.gen is None:
            token = int(torch.argmax(logits).item())
        else:
            scaled = (logits.float() - logits.max().float()) / sp.temperature
            probs = torch.softmax(scaled, dim=-1)
            if sp.top_p < 1.0:
                probs = top_p(probs, sp.top_p)
            token = int(torch.multinomial(probs, 1, generator=self.gen).item())
        if sp.logprobs is not None:
            entry = logprob(raw, token, sp.logprobs)
        if self.counts is not None:
            self.counts[token] += 1
        return token, entry


def greedy_rows(rows: torch.Tensor, which: list[int]) -> list[int]:
    """The argmax of each of ``rows[which]`` (one op and one copy to the host for a batch:
    what ``Sampler.next`` picks for a ``plain_greedy`` sampler, the first maximum on a tie)."""
    if not which:
        return []
    picked: list[int] = rows[which].argmax(dim=-1).tolist()
    return picked


def penalize(logits: torch.Tensor, counts: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """OpenAI's presence / frequency penalties: ``counts`` = times each token was generated."""
    return (logits.float() - counts * sp.frequency_penalty
            - (counts > 0).float() * sp.presence_penalty)


def scored(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Row ``i`` of ``logits`` is the distribution of ``tokens[i]``: its log-probability and
    the ``k`` most likely tokens, per row."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits, dim=-1)
    nxt = torch.tensor(tokens, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, nxt.unsqueeze(1)).squeeze(1).cpu().tolist()
    if k > 0:
        top_v, top_i = (t.cpu().tolist() for t in torch.topk(lp, k, dim=-1))
    else:
        top_v = top_i = [[] for _ in tokens]
    return [TokenLogprob(tok, value, tuple(zip(ids_k, vals_k, strict=True)))
            for tok, value, ids_k, vals_k in zip(tokens, chosen, top_i, top_v, strict=True)]


def logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """``token``'s log-probability under ``logits`` and the ``k`` most likely tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(lp, k)
        top = tuple(zip(ids.cpu().tolist(), values.cpu().tolist(), strict=True))
    return TokenLogprob(token, float(lp[token].item()), top)


def top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Zero out everything outside the smallest set whose mass reaches ``p``."""
    sorted_p, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
    drop = before >= p
    drop[0] = False  # the most likely token always stays (a tiny top_p rounds to 0 in fp32)
    sorted_p[drop] = 0.0
    out = torch.zeros_like(probs)
    out[order] = sorted_p
    return out / out.sum()


@torch.inference_mode()
def score_prompt(model: PreTrainedModel, prompt: list[int], k: int, allowed: int
                 ) -> tuple[TokenLogprob | None, ...]:
    """Every prompt token's log-probability given the ones before it (the first has none) and
    its ``k`` alternatives: a plain forward from position 0, ``SCORE_CHUNK`` tokens at a time
    (each chunk attends to the KV of the ones before; the logits held at once are one chunk's),
    over the tokenizer's first ``allowed`` ids."""
    cache = DynamicCache()
    out: list[TokenLogprob | None] = [None]
    last: torch.Tensor | None = None
    for start in range(0, len(prompt), SCORE_CHUNK):
        chunk = prompt[start : start + SCORE_CHUNK]
        ids = torch.tensor([chunk], device=model.device)
        pos = torch.arange(start, start + len(chunk), device=model.device).unsqueeze(0)
        res = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True,
                    logits_to_keep=0)
        logits = res.logits[0, :, :allowed].float()
        nxt = chunk if last is not None else chunk[1:]
        if last is not None:  # the previous chunk's last row predicts this chunk's first
            logits = torch.cat((last.unsqueeze(0), logits))
        last = logits[-1]
        out.extend(scored(logits[: len(nxt)], nxt, k))
    return tuple(out)
