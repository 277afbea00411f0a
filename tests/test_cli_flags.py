"""Every flag of demo / sim / chaos / cluster says what it does; durations take units."""

from __future__ import annotations

import argparse
import importlib

import pytest

from radixmesh.cli import COMMANDS

OWN = ("demo", "sim", "chaos", "cluster")


def command_parser(command: str) -> argparse.ArgumentParser:
    """``radixmesh COMMAND``'s parser (the tests of every command's flags import it)."""
    parser = argparse.ArgumentParser(prog=f"radixmesh {command}")
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    return parser


def command_args(command: str, *argv: str) -> argparse.Namespace:
    """``radixmesh COMMAND ARGV...``'s parsed flags (what its ``run`` is given)."""
    return command_parser(command).parse_args(list(argv))


@pytest.mark.parametrize("command", OWN)
def test_every_flag_has_help(command: str) -> None:
    missing = [a.option_strings[0] for a in command_parser(command)._actions
               if a.option_strings and not a.help]
    assert not missing, f"radixmesh {command}: no help text for {missing}"


def test_demo_durations_take_units_like_bench() -> None:
    args = command_parser("demo").parse_args(["--net-delay", "2ms", "--gossip-interval", "0.5s"])
    assert (args.net_delay, args.gossip_interval) == (0.002, 0.5)
    assert command_parser("demo").parse_args(["--net-delay", "0.01"]).net_delay == 0.01
    with pytest.raises(SystemExit):
        command_parser("demo").parse_args(["--net-delay", "2 parsecs"])


def test_cluster_ready_timeout_takes_units() -> None:
    assert command_parser("cluster").parse_args(["--ready-timeout", "5m"]).ready_timeout == 300.0
    assert command_parser("cluster").parse_args([]).ready_timeout == 180.0


def test_sim_entry_random_draws_every_requests_entry() -> None:
    from radixmesh.sim.sweep import requests_for

    parser = command_parser("sim")
    given = requests_for(parser.parse_args(["--requests", "40"]), False, 4)
    drawn = requests_for(parser.parse_args(["--requests", "40", "--entry", "random"]), False, 4)
    assert [r.id for r in given] == [r.id for r in drawn]
    assert [r.entry for r in given] == [i % 4 for i in range(40)] != [r.entry for r in drawn]
    with pytest.raises(SystemExit):
        parser.parse_args(["--entry", "nearest"])
