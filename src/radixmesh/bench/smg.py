"""The second centralized baseline: SMG 1.13 (pip ``smg``, the SGLang Model Gateway, Rust).

SMG is sglang-router's successor. Optional extra ``radixmesh[smg]`` (``pip install
smg==1.13.0``); policy ``smg`` of ``radixmesh bench`` runs it in front of ``none`` nodes::

    python -m smg launch --host 127.0.0.1 --port P --policy cache_aware \\
        --worker-urls URL... --prometheus-host 127.0.0.1 --prometheus-port M --log-level warn

(``smg launch`` is its router-only mode, the ``smg`` console script's first subcommand; the
metrics port must be set, or a second gateway on the machine fails to bind 29000.) Its
``cache_aware`` policy keeps an approximate radix tree per worker over the request text, with
the same knobs and defaults as sglang-router's (``--cache-threshold 0.3``,
``--balance-abs-threshold 64``, ``--balance-rel-threshold 1.5``). At start it registers every
worker URL (``GET /health`` on the worker, model discovery; a radixmesh node passes), then
``GET /readiness`` answers 200 with ``healthy_workers``: the run starts when that equals the
number of nodes. It forwards OpenAI ``/v1/completions`` and ``/v1/chat/completions`` bodies
to the chosen worker and returns the worker's response headers (``x-radixmesh-served-by`` and
the cached-token counts come through). Verified against smg 1.13.0 on this project's nodes.
Like sglang-router's, its hop to the workers crosses the emulated link (``bench/linkproxy.py``).
"""

from __future__ import annotations

from radixmesh.bench.sglang import Gateway

INSTALL_HINT = "smg is not installed: pip install 'smg==1.13.0'"


class Smg(Gateway):
    """``python -m smg launch --policy cache_aware`` in front of the run's nodes."""

    name = "smg"
    install_hint = INSTALL_HINT
    package = "smg"
    launcher = ("smg", "launch")
    extra_args = ("--log-level", "warn")
    # smg 1.13.0's defaults (smg/router_args.py ``RouterArgs``): worker load polls (its
    # expected-wait score reads running and waiting requests from vLLM's /metrics), the
    # no-contact and no-progress exclusions, the stale-record exclusion, the tree's eviction
    # timer, health checks (their interval, and their timeout: a check crosses the emulated
    # link, 12 s each way between regions 40 ms apart at time scale 300) and the warm-up window
    clocks = (("--load-monitor-interval", 10), ("--worker-stall-secs", 2),
              ("--worker-wedge-secs", 3), ("--worker-stale-secs", 15),
              ("--eviction-interval-secs", 60), ("--health-check-interval-secs", 60),
              ("--health-check-timeout-secs", 5), ("--worker-warmup-secs", 60))  # fmt: skip
    lists_models = True
