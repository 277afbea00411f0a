"""Why a node's predicted cached tokens differ from what llama.cpp reused (``make
llamacpp-check``).

Theory of operation
-------------------
Each request of a check run is a row: serving node, send and end times, prompt and
completion token counts, the node's prediction at acceptance and llama.cpp's ``cache_n``. The
classifier replays, per server, llama.cpp's own rules (``core/llamacpp_slots.py``: one
``LlamaCppSlots`` per server, requests started at their send time and ended at their end time,
outputs as tokens that match nothing) and sorts every mismatch by a mechanical rule::

    slot model == llama.cpp, prediction over   -> "over: slot held another prompt"
    slot model == llama.cpp, under by < block  -> "under: whole blocks"  (an LRU of blocks
                                                  floors what llama.cpp reuses per token)
    slot model == llama.cpp, under, a request running on that server at acceptance shares
                  what llama.cpp reused        -> "under: still running"  (the view learns a
                                                  prompt when it ends; the server runs it first)
    slot model == llama.cpp, under             -> "under: llama.cpp held more"  (its prompt
                                                  cache kept what the view evicted)
    otherwise                                  -> "not explained: over" / "not explained: under"

The replay sees the times the client saw, not the server's: a request the replay orders
wrongly (two sent within a scheduling step) lands in "not explained".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from radixmesh.core.llamacpp_slots import LlamaCppSlots, lcp


def replay(rows: Sequence[Mapping[str, Any]], prompts: Mapping[int, Sequence[int]],
           n_slots: int = 1) -> dict[int, int]:
    """The slot model's prediction per request ``seq`` (rows of one run, all servers)."""
    servers: dict[str, LlamaCppSlots] = {}
    events: list[tuple[float, int, Mapping[str, Any]]] = []
    for row in rows:
        events.append((row["t_send"], 1, row))
        events.append((row["t_done"], 0, row))
    events.sort(key=lambda e: (e[0], e[1]))
    out: dict[int, int] = {}
    for _, is_start, row in events:
        model = servers.setdefault(str(row["served_by"]), LlamaCppSlots(n_slots))
        prompt = tuple(prompts[row["seq"]])
        if is_start:
            out[row["seq"]] = model.start(row["seq"], prompt)
        else:
            filler = (-1 - row["seq"],) * max((row["completion_tokens"] or 1) - 1, 0)
            model.finish(row["seq"], prompt + filler)
    return out


def classify(rows: Sequence[Mapping[str, Any]], prompts: Mapping[int, Sequence[int]],
             block_size: int, n_slots: int = 1) -> dict[str, Any]:
    """Counts per class of the mismatching rows, and the slot model's own agreement."""
    model = replay(rows, prompts, n_slots)
    classes: Counter[str] = Counter()
    for row in rows:
        pred, actual, slot = row["predicted"], row["actual"], model[row["seq"]]
        if pred == actual:
            continue
        if slot != actual:
            classes["not explained: " + ("over" if pred > actual else "under")] += 1
        elif pred > actual:
            classes["over: slot held another prompt"] += 1
        elif actual - pred < block_size:
            classes["under: whole blocks"] += 1
        elif _running_share(row, rows, prompts) >= actual:
            classes["under: still running"] += 1
        else:
            classes["under: llama.cpp held more"] += 1
    agree = sum(model[r["seq"]] == r["actual"] for r in rows)
    return {"classes": dict(sorted(classes.items())), "slot_model_equal": agree}


def _running_share(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
                   prompts: Mapping[int, Sequence[int]]) -> int:
    """The longest prefix ``row``'s prompt shares with a request running on its server when
    it was sent."""
    mine = prompts[row["seq"]]
    return max((lcp(prompts[o["seq"]], mine) for o in rows
                if o["served_by"] == row["served_by"] and o["seq"] != row["seq"]
                and o["t_send"] < row["t_send"] < o["t_done"]), default=0)
