"""The ``loomray`` command line: the click group every command hangs on.

Store-side commands (``checkpoints`` [``quarantine``], ``show``, ``query``,
``prune``, ``compact``, ``lease repair``, ``tree``, ``timeline``, and the
steering commands ``approve``, ``deny``, ``signal``, ``pause``, ``cancel``,
``logs``, which write or read control objects and the journal in the store,
so they need no cluster) are in :mod:`loomray.cli.store`,
:mod:`loomray.cli.query`, :mod:`loomray.cli.prune` and
:mod:`loomray.cli.steering`; cluster commands (``submit``, ``status``,
``supervise``) in :mod:`loomray.cli.cluster`, ``resume`` and ``fork`` in
:mod:`loomray.cli.runs`; ``demo`` in :mod:`loomray.cli.demo`. Every command
takes ``--store URL`` (or ``LOOMRAY_STORE``) and, where a cluster is
involved, ``--address`` (or ``RAY_ADDRESS``). ``--json`` prints
machine-readable output. A user mistake prints one line on stderr and exits
2; a failed run exits 1; neither prints a traceback (``LOOMRAY_DEBUG=1``
does).

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

from loomray.cli.cluster import CLUSTER_COMMANDS
from loomray.cli.demo import demo
from loomray.cli.prune import prune
from loomray.cli.query import query
from loomray.cli.runs import fork, resume
from loomray.cli.steering import STEERING_COMMANDS
from loomray.cli.store import STORE_COMMANDS
from loomray.cli.ui_command import ui
from loomray.runtime.connection import apply_ray_env_defaults

# Ray reads these once, when first imported (nothing above imports it): bind to 127.0.0.1 for a user who
# runs `loomray demo` directly.
apply_ray_env_defaults()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="loomray")
def main() -> None:
    """loomray: durable long-running LLM agent sessions on Ray."""


for _command in (*STORE_COMMANDS, query, prune, *STEERING_COMMANDS, *CLUSTER_COMMANDS, resume, fork, demo, ui):
    main.add_command(_command)
