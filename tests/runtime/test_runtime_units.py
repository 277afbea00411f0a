"""Unit tests of the runtime's pure parts: config, OpenAI validation/shaping, detokenizer, netem."""

from __future__ import annotations

import asyncio
import json
import random
import time
from functools import partial

import pytest

from radixmesh.core.link import LinkConfig
from radixmesh.runtime.config import (
    ServeConfig,
    config_from_args,
    config_from_mapping,
    config_to_argv,
    parse_duration,
    parse_peers,
)
from radixmesh.runtime.metrics import RuntimeMetrics, parse_samples, render, sample_sum
from radixmesh.runtime.netem import Netem, NetemConfig, sleep_until
from radixmesh.runtime.openai_api import (
    ApiError,
    Detokenizer,
    StreamShaper,
    parse_chat,
    parse_completion,
    parse_json,
)
from test_cli_flags import command_args

MODELS = ["tiny"]

serve_args = partial(command_args, "serve")  # `radixmesh serve ARGS...`'s flags


# ----------------------------------------------------------------------------- config
def test_durations_and_peers() -> None:
    assert parse_duration("2ms") == pytest.approx(0.002)
    assert parse_duration("0.5s") == 0.5
    assert parse_duration(0.1) == 0.1
    assert parse_duration("250us") == pytest.approx(250e-6)
    assert parse_duration("1e-3s") == 0.001 and parse_duration("2m") == 120.0
    for bad in ("-1", "fast", "2 parsecs", True):
        with pytest.raises(ValueError):
            parse_duration(bad)  # type: ignore[arg-type]
    assert parse_peers("127.0.0.1:1, localhost:2,") == ("127.0.0.1:1", "localhost:2")
    for bad in ("nohost", "h:0", "h:99999", ":80"):
        with pytest.raises(ValueError):
            parse_peers(bad)


def test_flags_override_toml_override_defaults(tmp_path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('node-id = "a"\nport = 9001\npeers = ["127.0.0.1:9002"]\n'
                    'net_delay = "2ms"\npolicy = "paper"\n')
    cfg = config_from_args(serve_args("--config", str(toml), "--port", "9005",
                                      "--gossip-interval", "100ms"))
    assert (cfg.node_id, cfg.port, cfg.policy) == ("a", 9005, "paper")
    assert cfg.peers == ("127.0.0.1:9002",) and cfg.net_delay == pytest.approx(0.002)
    assert cfg.gossip_interval == pytest.approx(0.1)
    assert cfg.cache_tokens == ServeConfig().cache_tokens  # untouched default
    gossip = cfg.gossip_config()
    assert gossip.interval_s == pytest.approx(0.1) and gossip.suspect_after_s >= 0.4


def test_bad_config_is_a_value_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown configuration key"):
        config_from_mapping({"colour": "blue"})
    with pytest.raises(ValueError):
        config_from_mapping({"policy": "fastest"})
    with pytest.raises(ValueError):
        config_from_mapping({"port": "eighty"})
    with pytest.raises(ValueError):
        config_from_mapping({"net_loss": 2})


def test_config_to_argv_round_trips() -> None:
    values = {"node_id": "x", "peers": ["127.0.0.1:1", "127.0.0.1:2"], "net_delay": 0.002,
              "gossip_mode": "snapshot", "threads": 1}
    cfg = config_from_args(serve_args(*config_to_argv(values)))
    assert cfg == config_from_mapping(values)
    node = cfg.node_config(_fingerprint(), incarnation=7)
    assert node.seeds == ("127.0.0.1:1", "127.0.0.1:2") and node.incarnation == 7


def _fingerprint():  # type: ignore[no-untyped-def]
    from radixmesh.core.blocks import Fingerprint

    return Fingerprint("m", "t", 16)


# ----------------------------------------------------------------------------- OpenAI
def _err(fn, *args) -> ApiError:  # type: ignore[no-untyped-def]
    with pytest.raises(ApiError) as info:
        fn(*args)
    body = info.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return info.value


def test_malformed_bodies() -> None:
    assert _err(parse_json, b"{not json").status == 400
    assert _err(parse_json, b"[1, 2]").status == 400
    assert _err(parse_json, b"\xff\xfe").status == 400


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"prompt": "x"}, "model", 400),
        ({"model": "gpt-9", "prompt": "x"}, "model", 404),
        ({"model": 3, "prompt": "x"}, "model", 400),
        ({"model": "tiny"}, "prompt", 400),
        ({"model": "tiny", "prompt": 5}, "prompt", 400),
        ({"model": "tiny", "prompt": ["a", 1]}, "prompt", 400),
        ({"model": "tiny", "prompt": [1, -2]}, "prompt", 400),
        ({"model": "tiny", "prompt": "x", "max_tokens": "8"}, "max_tokens", 400),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens", 400),
        ({"model": "tiny", "prompt": "x", "max_tokens": True}, "max_tokens", 400),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature", 400),
        ({"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature", 400),
        ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p", 400),
        ({"model": "tiny", "prompt": "x", "n": 17}, "n", 400),
        ({"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs", 400),
        ({"model": "tiny", "prompt": "x", "stream": "yes"}, "stream", 400),
        ({"model": "tiny", "prompt": "x", "stop": 7}, "stop", 400),
        ({"model": "tiny", "prompt": "x", "stop": ["a"] * 5}, "stop", 400),
        ({"model": "tiny", "prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty", 400),
    ],
)
def test_completion_validation(body, param, status) -> None:  # type: ignore[no-untyped-def]
    err = _err(parse_completion, body, MODELS)
    assert (err.param, err.status) == (param, status)


def test_completion_defaults_and_batch_of_one() -> None:
    req = parse_completion({"model": "tiny", "prompt": ["hi"], "stream": True,
                            "stream_options": {"include_usage": True}, "seed": 3}, MODELS)
    assert (req.prompt_text, req.max_tokens, req.temperature) == ("hi", 16, 1.0)
    assert req.stream and req.include_usage and req.sampling().seed == 3
    ids = parse_completion({"model": "tiny", "prompt": [[1, 2, 3]]}, MODELS)
    assert ids.prompt_ids == (1, 2, 3)


def test_chat_validation() -> None:
    ok = parse_chat({"model": "tiny", "max_completion_tokens": 4, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, MODELS)
    assert ok.max_tokens == 4 and ok.messages[1] == {"role": "user", "content": "hi"}
    assert _err(parse_chat, {"model": "tiny", "messages": []}, MODELS).param == "messages"
    assert _err(parse_chat, {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
                MODELS).status == 400
    assert _err(parse_chat, {"model": "tiny", "messages": [{"role": "user", "content": 1}]},
                MODELS).status == 400
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert _err(parse_chat, {"model": "tiny", "messages": [{"role": "user", "content": image}]},
                MODELS).code == "unsupported_value"


def _bytes_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_holds_back_partial_utf8_and_stop_prefixes() -> None:
    det = Detokenizer(_bytes_decode, stop=["END"])
    out = [det.push(b) for b in "hé E".encode()]
    assert "".join(out) == "hé "  # 'E' could start "END": held back
    assert det.push(ord("N")) == "" and det.push(ord("D")) == "" and det.stopped
    assert det.flush() == ""
    det2 = Detokenizer(_bytes_decode, stop=["END"])
    text = "".join(det2.push(b) for b in b"aEb") + det2.flush()
    assert text == "aEb" and not det2.stopped


def test_stream_shaper_chat_chunks() -> None:
    req = parse_chat({"model": "tiny", "stream": True, "stream_options": {"include_usage": True},
                      "messages": [{"role": "user", "content": "x"}]}, MODELS)
    sh = StreamShaper(req, "chatcmpl-1")
    chunks = [sh.start(), sh.text("hi"), sh.finish("length"), sh.usage({"prompt_tokens": 1})]
    docs = [json.loads(c.decode()[len("data: "):]) for c in chunks if c]
    assert docs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert docs[1]["choices"][0]["delta"]["content"] == "hi"
    assert docs[2]["choices"][0]["finish_reason"] == "length"
    assert docs[3]["choices"] == [] and docs[3]["usage"] == {"prompt_tokens": 1}
    assert sh.done() == b"data: [DONE]\n\n"


def test_prometheus_text() -> None:
    m = RuntimeMetrics()
    m.requests["forwarded"] += 2
    text = render(m, {"queue_depth": 3.0}, {"gossip_bytes_out": 10.0}, {"b": "suspect"}, "a")
    assert 'radixmesh_requests_total{route="forwarded"} 2' in text
    assert "radixmesh_queue_depth 3" in text and "radixmesh_core_gossip_bytes_out_total 10" in text
    assert 'radixmesh_peers{state="suspect"} 1' in text
    assert all(line.startswith("#") or " " in line for line in text.splitlines())
    samples = parse_samples(text)  # the page reads back through the one parser
    assert samples['radixmesh_requests_total{route="forwarded"}'] == 2.0
    assert samples["radixmesh_queue_depth"] == 3.0
    assert sample_sum(samples, "radixmesh_requests_total") == 2.0
    assert sample_sum(samples, "radixmesh_peers") == 1.0


def test_parse_samples_keeps_what_it_can_read() -> None:
    page = (
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 256.0\n'
        'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n'
        "not a sample line\n"
        "plain 2\n"
    )
    samples = parse_samples(page)
    assert samples == {'vllm:prefix_cache_hits_total{engine="0",model_name="m"}': 256.0,
                       'vllm:prefix_cache_hits_created{engine="0",model_name="m"}': 1.7e9,
                       "plain": 2.0}  # fmt: skip
    assert sample_sum(samples, "vllm:prefix_cache_hits_total") == 256.0
    assert sample_sum(samples, "absent") == 0.0


# ----------------------------------------------------------------------------- netem
def test_netem_loss_is_seeded_and_gossip_only() -> None:
    def drops(seed: int) -> list[bool]:
        n = Netem(NetemConfig(loss=0.3), seed=seed)
        return [n.drop_outgoing("p", "h:1", gossip=True) for _ in range(200)]

    assert drops(1) == drops(1) and 30 < sum(drops(1)) < 90
    n = Netem(NetemConfig(loss=1.0))
    assert not n.drop_outgoing("p", "h:1", gossip=False)


def test_netem_partition_both_directions() -> None:
    n = Netem(NetemConfig())
    n.set_partition(["b", "127.0.0.1:9"])
    assert n.drop_outgoing("b", None, gossip=False) and n.drop_incoming(None, "127.0.0.1:9")
    assert not n.drop_incoming("c", "127.0.0.1:10")
    assert n.partitioned == frozenset({"b", "127.0.0.1:9"})
    n.set_partition([" ", ""])  # blanks are ignored
    assert not n.drop_outgoing("b", None, gossip=True) and n.partitioned == frozenset()
    assert n.dropped_partition == 2


def test_netem_takes_its_decisions_from_the_core_link_model() -> None:
    assert NetemConfig is LinkConfig  # one link model: the runtime's name for it
    n = Netem(NetemConfig(delay_s=0.01, jitter_s=0.02, duplicate=0.5), seed=3)
    mirror = random.Random(3)
    assert n.one_way_delay() == 0.01 + 0.02 * mirror.random()
    dups = [n.duplicate_now() for _ in range(400)]
    assert dups == [mirror.random() < 0.5 for _ in range(400)]
    assert n.duplicated == sum(dups) and 150 < n.duplicated < 250
    quiet = Netem(NetemConfig())
    assert not quiet.config.active and quiet.one_way_delay() == 0.0
    assert not any(quiet.duplicate_now() for _ in range(100))
    with pytest.raises(ValueError):
        NetemConfig(loss=2.0)


def test_netem_delays_each_chunk_without_accumulating(
        virtual_loop: asyncio.AbstractEventLoop) -> None:
    async def scenario() -> list[float]:
        loop = asyncio.get_running_loop()
        n = Netem(NetemConfig(delay_s=1.0), clock=loop.time)

        async def source():  # type: ignore[no-untyped-def]
            for i in range(4):  # a chunk every 10 ms, much faster than the delay
                yield bytes([i])
                await asyncio.sleep(0.01)  # the source's pacing (under test), not a wait

        t0 = loop.time()
        return [loop.time() - t0 async for _ in n.delayed(source())]

    times = virtual_loop.run_until_complete(scenario())
    # each chunk is held for the delay from its own arrival: released 10 ms apart as they
    # came, not a delay apart (which is what delays that add up would give)
    assert times == pytest.approx([1.0, 1.01, 1.02, 1.03], abs=1e-9)


def test_sleep_until_never_wakes_early_under_uvloop() -> None:
    # uvloop's timers fire up to a millisecond early (whole milliseconds on a cached clock):
    # an emulated 10 ms link measured 9.9 ms in CI before the netem slept to a deadline
    uvloop = pytest.importorskip("uvloop")

    async def shortfalls() -> list[float]:
        out = []
        for i in range(60):
            start = time.monotonic()
            deadline = start + 0.0003 + 0.00037 * (i % 17)
            await sleep_until(deadline)
            out.append(deadline - time.monotonic())
        return out

    assert max(uvloop.run(shortfalls())) <= 0.0
