"""``radixmesh emulate``: an emulated vLLM engine — vLLM's HTTP API and KV events, no model.

Usage
-----
::

    radixmesh emulate --profile h100-llama3-8b --port 8100 \\
        --kv-events tcp://*:5557 --kv-replay tcp://*:5558 [--time-scale 1] \\
        [--tokenizer DIR] [--served-model-name NAME] [--host 127.0.0.1]

    radixmesh serve --engine vllm --engine-url http://127.0.0.1:8100 \\
        --kv-events tcp://*:5557 --kv-replay tcp://*:5558 ...

The process answers like a vLLM 0.32 server (``/v1/completions`` with text or token-id
prompts, streaming, ``return_tokens_as_token_ids``, ``usage.prompt_tokens_details.
cached_tokens``; ``/v1/chat/completions``; ``/v1/models``; ``/health``; ``/metrics`` with vLLM's
metric names) and publishes vLLM-format KV events with a replay socket, so a node fronts it
exactly as it fronts a real vLLM. Behind the API runs the project's continuous-batching
scheduler (``core/scheduler.py``) with a real prefix cache of token ids under the profile's KV
block budget; each step lasts what the profile (``core/profile.py``, ``radixmesh/profiles/``)
says that step takes on the emulated GPU, times ``--time-scale`` (``0``: as fast as the CPU
goes). Output tokens are deterministic, not a model's. ``/v1/models``, ``/health``, the
``emulator_info`` metric and the start-up line name the profile and say "emulated";
``emulator_lag_seconds_total`` against ``emulator_busy_seconds_total`` in ``/metrics`` tells
whether this machine kept up with the profile's speed.

Tests use the same engine in-process through ``radixmesh.emulate.fake`` (a zero-time profile
over a token budget; fault knobs in ``engine.faults``).

Modules: ``loop.py`` (the scheduler on the wall clock), ``server.py`` (HTTP), ``protocol.py``
(vLLM's request / response shapes), ``events.py`` (KV events, fault knobs), ``metrics.py``,
``cli.py``, ``fake.py`` (the test dress).
"""
