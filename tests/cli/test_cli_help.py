"""Every command's --help as a newcomer reads it: no markup printed literally, every option explained."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from loomray.cli.main import main


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    found: list[tuple[tuple[str, ...], click.Command]] = [(prefix, group)]
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            found += _commands(command, (*prefix, name))
        else:
            found.append(((*prefix, name), command))
    return found


COMMANDS = _commands(main)


@pytest.mark.parametrize("path, command", COMMANDS, ids=[" ".join(p) or "loomray" for p, _ in COMMANDS])
def test_help_reads_as_text_and_explains_every_option(path, command):
    out = CliRunner().invoke(main, [*path, "--help"], terminal_width=100)
    assert out.exit_code == 0, out.output
    assert "``" not in out.output and ":func:" not in out.output and ":class:" not in out.output, out.output
    assert "sess..." not in out.output, out.output
    unexplained = [p.opts[0] for p in command.params
                   if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip()]
    assert not unexplained, f"{' '.join(path)}: options without help: {unexplained}"


def test_shell_completion_completes_commands_and_options():
    # What `eval "$(_LOOMRAY_COMPLETE=bash_source loomray)"` (the main --help) installs asks this.
    env = {"_LOOMRAY_COMPLETE": "bash_complete", "COMP_WORDS": "loomray appr", "COMP_CWORD": "1"}
    out = CliRunner().invoke(main, [], prog_name="loomray", env=env)
    assert out.exit_code == 0 and "plain,approvals" in out.output.splitlines() and "approve" in out.output
    env = {"_LOOMRAY_COMPLETE": "bash_complete", "COMP_WORDS": "loomray cancel --y", "COMP_CWORD": "2"}
    assert "plain,--yes" in CliRunner().invoke(main, [], prog_name="loomray", env=env).output.splitlines()
    source = CliRunner().invoke(main, [], prog_name="loomray", env={"_LOOMRAY_COMPLETE": "bash_source"})
    assert "_LOOMRAY_COMPLETE=bash_complete" in source.output
