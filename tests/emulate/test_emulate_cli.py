"""``radixmesh emulate``'s flags: a bad profile, tokenizer or time scale is a usage error
(exit 2) naming the flag; good flags build an engine that names its profile."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from radixmesh.cli import main
from radixmesh.emulate import cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "flag"), [
    (("--profile", "no-such-profile"), "--profile"),
    (("--profile", "h100-llama3-8b", "--time-scale", "-1"), "--time-scale"),
    (("--profile", "h100-llama3-8b", "--kv-replay", "tcp://*:1"), "--kv-replay"),
    (("--profile", "h100-llama3-8b", "--tokenizer", "/no/such/dir"), "--tokenizer"),
])
def test_bad_flags_are_usage_errors_naming_the_flag(argv: tuple[str, ...], flag: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=flag):
        cli.build(parse(*argv, "--port", "0"))
    assert main(["emulate", *argv, "--port", "0"]) == 2
    assert flag in capsys.readouterr().err


def test_a_profile_file_and_a_served_name(tmp_path: Path) -> None:
    from radixmesh.core.profile import dumps, resolve

    path = tmp_path / "mine.toml"
    path.write_text(dumps(resolve("a10g-llama3-8b")))
    engine = cli.build(parse("--profile", str(path), "--port", "0", "--time-scale", "0.5",
                             "--served-model-name", "served"))
    assert engine.profile.name == "a10g-llama3-8b" and engine.model == "served"
    assert engine.loop.time_scale == 0.5 and engine.events is None
    assert engine.describe()["emulated"] is True


def test_events_without_a_replay_flag_get_a_replay_socket_on_the_same_host() -> None:
    import asyncio

    async def main() -> tuple[str, str]:
        engine = cli.build(parse("--profile", "cpu-tiny", "--port", "0",
                                 "--kv-events", "tcp://127.0.0.1:0"))
        await engine.start()
        try:
            return engine.kv_endpoint, engine.replay_endpoint
        finally:
            await engine.stop()

    events, replay = asyncio.run(main())
    assert events.startswith("tcp://*:") and replay.startswith("tcp://*:") and events != replay
