"""Every ``radixmesh`` subcommand prints its help: argparse formats each flag's help text
(a bare ``%`` in one, as "50%", crashed ``serve --help``)."""

from __future__ import annotations

import pytest

from radixmesh.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_prints_its_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out
