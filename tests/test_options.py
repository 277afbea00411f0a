"""One table of node options (radixmesh/options.py): every command spells a concept the same
way, renamed flags and TOML keys still work for one release with a warning, and the network
presets (local / lan / wan) lie under the TOML file and the flags."""

from __future__ import annotations

import argparse

import pytest

from radixmesh.core.config import GossipConfig
from radixmesh.engine.presets import DEFAULT_PRESET
from radixmesh.options import NETWORKS, OPTIONS, RENAMED
from radixmesh.runtime.config import (
    ServeConfig,
    add_serve_arguments,
    config_from_args,
    config_from_mapping,
)
from test_cli_flags import command_parser

NODE_COMMANDS = ("serve", "cluster", "bench", "sim", "chaos", "demo")


@pytest.mark.parametrize("command", NODE_COMMANDS)
def test_an_old_name_is_only_a_hidden_alias_of_the_new_one(command: str) -> None:
    """A command takes a shared option under the table's name; an old name is accepted only
    as the hidden alias that sets the same value (and warns)."""
    olds = {"--" + old.replace("_", "-"): new for old, new in RENAMED.items()}
    seen = 0
    for action in command_parser(command)._actions:
        for flag in set(action.option_strings) & set(olds):
            assert action.help == argparse.SUPPRESS and action.dest == olds[flag], flag
            seen += 1
    assert seen >= 1  # every command has at least one renamed option (policy)


@pytest.mark.parametrize(
    ("command", "old", "new", "value", "expected"),
    [
        ("sim", "--comm-delay", "net_delay", "5ms", "5ms"),
        ("sim", "--jitter", "net_jitter", "1ms", "1ms"),
        ("sim", "--loss", "net_loss", "0.1", 0.1),
        ("sim", "--fanout", "gossip_fanout", "2", 2),
        ("bench", "--comm-delay", "net_delay", "2ms,1s", [0.002, 1.0]),
        ("bench", "--policies", "policy", "none,cost", ["none", "cost"]),
        ("bench", "--engine-preset", "preset", "micro", "micro"),
        ("demo", "--comm-delay", "net_delay", "3ms", 0.003),
        ("demo", "--policies", "policy", "none,cost", "none,cost"),
        ("serve", "--comm-delay", "net_delay", "3ms", "3ms"),  # converted by ServeConfig
        ("cluster", "--fanout", "gossip_fanout", "5", "5"),
    ],
)
def test_old_flag_names_still_work_and_warn(  # type: ignore[no-untyped-def]
    capsys, command: str, old: str, new: str, value: str, expected: object
) -> None:
    args = command_parser(command).parse_args([old, value])
    assert getattr(args, new) == expected
    err = capsys.readouterr().err
    assert f"{old} is deprecated, use {OPTIONS[new].flag}" in err


def test_new_flag_names_do_not_warn(capsys) -> None:  # type: ignore[no-untyped-def]
    args = command_parser("sim").parse_args(["--net-delay", "5ms", "--gossip-fanout", "2"])
    assert (args.net_delay, args.gossip_fanout) == ("5ms", 2)
    assert capsys.readouterr().err == ""


def test_sim_load_bound_minus_one_is_the_old_spelling_of_off(capsys) -> None:  # type: ignore[no-untyped-def]
    assert command_parser("sim").parse_args(["--load-bound", "off"]).load_bound is None
    assert capsys.readouterr().err == ""
    assert command_parser("sim").parse_args(["--load-bound", "-1"]).load_bound is None
    assert "--load-bound off" in capsys.readouterr().err
    assert command_parser("sim").parse_args(["--load-bound", "0.5"]).load_bound == 0.5


def test_bench_preset_names_the_model_and_a_sweep_name_is_deprecated(capsys) -> None:  # type: ignore[no-untyped-def]
    from radixmesh.bench import plan

    args = command_parser("bench").parse_args(["--preset", "quick", "--requests", "4"])
    specs = plan.specs_from_args(args)
    assert "--preset quick is deprecated, use --sweep quick" in capsys.readouterr().err
    by_sweep = plan.specs_from_args(command_parser("bench").parse_args(["--sweep", "quick",
                                                                 "--requests", "4"]))
    assert [s.name for s in specs] == [s.name for s in by_sweep]
    assert {s.preset for s in specs} == {DEFAULT_PRESET}
    micro = plan.specs_from_args(command_parser("bench").parse_args(["--preset", "micro"]))
    assert {s.preset for s in micro} == {"micro"} and capsys.readouterr().err == ""


def test_old_toml_keys_still_work_and_warn(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    toml = tmp_path / "node.toml"
    toml.write_text('comm-delay = "4ms"\nfanout = 5\n')
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_serve_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--config", str(toml)]))
    assert (cfg.net_delay, cfg.gossip_fanout) == (pytest.approx(0.004), 5)
    err = capsys.readouterr().err
    assert "key comm-delay is deprecated, use net-delay" in err
    assert "key fanout is deprecated, use gossip-fanout" in err
    with pytest.raises(ValueError, match="set twice"):
        config_from_mapping({"net_delay": "1ms", "comm_delay": "2ms"})


def test_lan_is_the_default_and_local_wan_change_only_their_fields() -> None:
    assert ServeConfig.lan() == ServeConfig()
    for name, make in (("local", ServeConfig.local), ("wan", ServeConfig.wan)):
        cfg = make()
        assert cfg.network == name
        for key, value in NETWORKS[name].items():
            assert getattr(cfg, key) == value
        untouched = set(ServeConfig.__dataclass_fields__) - set(NETWORKS[name]) - {"network"}
        assert all(getattr(cfg, k) == getattr(ServeConfig(), k) for k in untouched)


def test_wan_gossip_takes_the_core_wan_cadences() -> None:
    from radixmesh.core.blocks import Fingerprint

    node = ServeConfig.wan().node_config(Fingerprint("m", "t", 16), incarnation=1)
    wan = GossipConfig.wan()
    assert node.gossip.interval_s == wan.interval_s
    assert (node.gossip.suspect_after_s, node.gossip.dead_after_s) == (10.0, 60.0)
    assert node.gossip.membership == wan.membership and node.gossip.exchange == wan.exchange
    assert node.forward.silence_timeout_s == 5.0


def test_network_preset_lies_under_toml_and_flags(tmp_path) -> None:  # type: ignore[no-untyped-def]
    toml = tmp_path / "node.toml"
    toml.write_text('network = "wan"\nforward-timeout = "3s"\n')
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_serve_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--config", str(toml),
                                              "--gossip-interval", "1s"]))
    assert cfg.network == "wan" and cfg.dead_timeout == 60.0  # the preset
    assert cfg.forward_timeout == 3.0 and cfg.gossip_interval == 1.0  # TOML, flag win
    local = config_from_args(parser.parse_args(["--config", str(toml), "--network", "local"]))
    assert local.gossip_interval == NETWORKS["local"]["gossip_interval"]
    assert local.forward_timeout == 3.0 and local.dead_timeout == 0.0
    assert config_from_mapping({"network": "local"}) == ServeConfig.local()
    with pytest.raises(ValueError, match="network must be one of"):
        config_from_mapping({"network": "moon"})


def test_chaos_defaults_are_the_local_preset() -> None:
    args = command_parser("chaos").parse_args([])
    assert args.gossip_interval == NETWORKS["local"]["gossip_interval"]
    assert args.forward_timeout == NETWORKS["local"]["forward_timeout"]
    assert args.preset == "micro" and args.policy == "paper"


def test_cluster_takes_the_toml_file_under_its_flags_and_keeps_secrets_off_argv(  # type: ignore[no-untyped-def]
    tmp_path, capsys
) -> None:
    from radixmesh.runtime.cluster import LocalCluster, cluster_options

    toml = tmp_path / "mesh.toml"
    toml.write_text('policy = "paper"\ngossip-interval = "200ms"\ncomm-delay = "3ms"\n'
                    'cluster-key = "0123456789abcdef0123"\n')
    args = command_parser("cluster").parse_args(["--config", str(toml), "--policy", "cost"])
    options, env = cluster_options(args)
    assert options == {"policy": "cost", "gossip_interval": "200ms", "net_delay": "3ms"}
    assert env == {"RADIXMESH_CLUSTER_KEY": "0123456789abcdef0123"}
    assert "comm-delay is deprecated" in capsys.readouterr().err
    argv = LocalCluster(2, options, ports=[1, 2]).argv(0)
    assert "--policy" in argv and "--cluster-key" not in argv
    toml.write_text('join = ["127.0.0.1:9"]\n')
    with pytest.raises(ValueError, match="set per node"):
        LocalCluster(2, cluster_options(args)[0], ports=[1, 2])
    toml.write_text('policy = "fastest"\n')
    with pytest.raises(ValueError):
        cluster_options(args)
