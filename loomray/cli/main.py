"""The ``loomray`` command line: the click group every command hangs on.

Store-side commands (``checkpoints`` [``quarantine``], ``show``, ``query``,
``prune``, ``compact``, ``lease repair``, ``tree``, ``timeline``, and the
steering commands ``approve``, ``deny``, ``signal``, ``pause``, ``cancel``,
``logs``, which write or read control objects and the journal in the store,
so they need no cluster) are in :mod:`loomray.cli.store`,
:mod:`loomray.cli.query`, :mod:`loomray.cli.prune` and
:mod:`loomray.cli.steering`; cluster commands (``submit``, ``status``,
``supervise``) in :mod:`loomray.cli.cluster`, ``resume`` and ``fork`` in
:mod:`loomray.cli.runs`, ``explore`` in :mod:`loomray.cli.explore_cmd`; ``demo`` in :mod:`loomray.cli.demo`. Every command
takes ``--store URL`` (or ``LOOMRAY_STORE``) and, where a cluster is
involved, ``--address`` (or ``RAY_ADDRESS``), before or after the command's
name. ``--json`` prints machine-readable output. Exit codes: 0 success, 2 a
user mistake (one line on stderr), 1 a failed run or a store or cluster
failure that retries did not cure, 130 interrupted; no traceback is printed
(``LOOMRAY_DEBUG=1`` prints it).

Output: tables fit the terminal's width (optional columns are dropped, ids,
statuses and times are never cut); ``--json`` times are ISO 8601 with the
"T" and a zone, dollars are rounded to 6 decimals. Long commands (``query``,
``prune``, ``compact``) report progress on stderr when it is a terminal, or
with ``--progress``.

No command module imports Ray when it is imported: ``loomray --help`` and the
store-side commands stay fast.
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
