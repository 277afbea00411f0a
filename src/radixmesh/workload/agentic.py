"""Agentic tool use: one long system prompt for all, per-task scratchpads growing step by step.

Every request starts with the same tool-use system prompt (~1,800 characters at scale 1: the
agent's rules and ``TOOLS`` tool descriptions with their arguments), then its task, then the
scratchpad of the steps taken so far (``Thought`` / ``Action`` / ``Observation``), ending in
``Thought:`` for the next step. Step k of a task extends step k-1's prompt by one step, so the
system prompt is shared by everything and each task's scratchpad by its own later steps.

A task has 2–7 steps and ends early when its next prompt would exceed ``max_chars``
(``MAX_CHARS``; below scale 1 the scratchpad's share of it shrinks with ``scale``); tasks
interleave (``width`` open at a time), entry nodes are round-robin as in the paper's schedule.
A step waits for the one before it (``Request.after``: the agent needs that tool call's
observation), whatever the schedule.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from radixmesh.workload.corpus import Corpus
from radixmesh.workload.generated import interleave, lognormal_chars
from radixmesh.workload.request import Request

TOOLS = ("search", "read_page", "calculator", "python", "sql_query", "send_email", "calendar",
         "weather")  # fmt: skip
RULES = (
    "You are an autonomous agent that solves tasks with tools. Work step by step. At each step "
    "write one Thought line, then one Action line of the form tool_name[json arguments]. You "
    "will then see an Observation with the tool's result. Repeat until you can answer, then "
    "write Action: finish[answer]. Never invent observations; never call a tool that is not "
    "listed; keep arguments valid JSON.\n\nTools:\n"
)
TOOL_CHARS = 180.0
TASK_CHARS = 200.0
THOUGHT_CHARS = 110.0
OBSERVATION_CHARS = 230.0
MAX_CHARS = 3500
MIN_STEPS, MAX_STEPS = 2, 7
WIDTH = 6
MAX_TOKENS = 8


def system_prompt(seed: int, corpus: Corpus, scale: float) -> str:
    rng = random.Random(f"radixmesh-agentic/{seed}/system")
    tools = []
    for name in TOOLS:
        desc = corpus.text(rng, lognormal_chars(rng, TOOL_CHARS * scale, 0.2))
        tools.append(f'- {name}: {desc}. Arguments: {{"query": string, "limit": integer}}')
    return RULES + "\n".join(tools) + "\n\n"


def task(
    index: int,
    seed: int,
    corpus: Corpus,
    scale: float,
    system: str,
    max_chars: int | None = None,
) -> Iterator[Request]:
    """One task's steps, in order; ``max_chars`` defaults to the system prompt plus
    ``MAX_CHARS`` minus it, times ``scale`` (≤ 1): the scratchpad's budget scales."""
    if max_chars is None:
        max_chars = int(len(system) + max(MAX_CHARS - len(system), 0) * min(scale, 1.0))
    rng = random.Random(f"radixmesh-agentic/{seed}/task/{index}")
    group = f"task/{index:04d}"
    text = f"{system}Task: {corpus.text(rng, lognormal_chars(rng, TASK_CHARS * scale))}.\n\n"
    for step in range(rng.randint(MIN_STEPS, MAX_STEPS)):
        prompt = text + "Thought:"
        if step > 0 and len(prompt) > max_chars:
            return
        yield Request(id=f"{group}/s{step}", prompt=prompt, max_tokens=MAX_TOKENS, group=group,
                      prefix_chars=len(system))  # fmt: skip
        thought = corpus.text(rng, lognormal_chars(rng, THOUGHT_CHARS * scale))
        tool = rng.choice(TOOLS)
        query = corpus.text(rng, lognormal_chars(rng, 40 * scale))
        obs = corpus.text(rng, lognormal_chars(rng, OBSERVATION_CHARS * scale))
        text += (f"Thought: {thought}\nAction: {tool}[{{\"query\": \"{query}\", \"limit\": "
                 f"{rng.randint(1, 10)}}}]\nObservation: {obs}\n")  # fmt: skip


def requests(n: int, seed: int, corpus: Corpus, scale: float = 1.0) -> list[Request]:
    system = system_prompt(seed, corpus, scale)
    rng = random.Random(f"radixmesh-agentic/{seed}")
    return interleave(
        lambda i: task(i, seed, corpus, scale, system),
        n,
        WIDTH,
        rng,
    )
