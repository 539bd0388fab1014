"""The ``loomray`` command line: the click group every command hangs on.

The commands, their common options (``--store``, ``--address``, ``--json``,
before or after the command's name) and exit codes are listed in docs/api.md
("Command line"); each group lives in its own module (:mod:`loomray.cli.store`,
``query``, ``prune``, ``steering``, ``cluster``, ``runs``, ``explore_cmd``,
``demo``). No command module imports Ray when it is imported: ``loomray
--help`` and the store-side commands stay fast.
"""

from __future__ import annotations

import click

from loomray.cli.approvals import approvals
from loomray.cli.cluster import CLUSTER_COMMANDS
from loomray.cli.common import ADDRESS_HELP, STORE_HELP
from loomray.cli.demo import demo
from loomray.cli.explore_cmd import explore
from loomray.cli.prune import prune
from loomray.cli.query import query
from loomray.cli.runs import fork, resume
from loomray.cli.steering import STEERING_COMMANDS
from loomray.cli.store import STORE_COMMANDS
from loomray.cli.ui_command import ui
from loomray.runtime.connection import apply_ray_env_defaults


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="loomray")
@click.option("--store", "store_url", default=None, metavar="URL", help=STORE_HELP + " Every command takes it too.")
@click.option("--address", default=None, metavar="ADDR", help=ADDRESS_HELP + " Every cluster command takes it too.")
def main(store_url: str | None, address: str | None) -> None:
    """loomray: durable long-running LLM agent sessions on Ray.

    Shell completion: eval "$(_LOOMRAY_COMPLETE=bash_source loomray)" in
    ~/.bashrc (zsh_source for zsh, fish_source for fish).
    """
    # Ray reads these once, when first imported (no command imports it before this runs): a local cluster
    # binds to 127.0.0.1. Set when a command runs, not when this module is imported, so a program that
    # imports loomray's CLI keeps its own Ray environment.
    apply_ray_env_defaults()


for _command in (*STORE_COMMANDS, query, prune, *STEERING_COMMANDS, approvals, *CLUSTER_COMMANDS, resume, fork,
                 explore, demo, ui):
    main.add_command(_command)
