"""``--actor-options``, ``--resources`` and ``--runtime-env``: how a command's sessions ask Ray for a place.

Merged and checked here (docs/api.md, "Command line"), then stored with each session the command starts, so
every later incarnation of it (a restart after node loss, an adoption) asks for the same place.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import yaml

from loomray.cli.common import CliError
from loomray.errors import LoomrayUserError


def _read(value: str, flag: str) -> Any:
    """``value`` as JSON, or the YAML/JSON document of ``@path``."""
    text, where = value, flag
    if value.startswith("@"):
        path = Path(value[1:]).expanduser()
        try:
            text = path.read_text()
        except OSError as e:
            raise CliError(f"{flag}: cannot read {path}: {e.strerror or e}") from e
        where = f"{flag} {path}"
    try:
        return yaml.safe_load(text)  # JSON is YAML; safe_load builds plain data only
    except yaml.YAMLError as e:
        raise CliError(f"{where}: not JSON or YAML: {str(e).splitlines()[0]}") from e


def _mapping(value: str | None, flag: str) -> dict[str, Any] | None:
    if value is None:
        return None
    data = _read(value, flag)
    if not isinstance(data, dict):
        raise CliError(f"{flag} must be a JSON object (or @file.yaml holding a mapping), got {type(data).__name__}")
    return data


def actor_options_from(actor_options: str | None, resources: str | None, runtime_env: str | None) -> dict[str, Any]:
    """The merged, checked actor options of the three flags (``{}`` when none is given)."""
    from loomray.runtime.actors import check_actor_options  # imports Ray

    options = _mapping(actor_options, "--actor-options") or {}
    for key, value, flag in (("resources", resources, "--resources"), ("runtime_env", runtime_env, "--runtime-env")):
        data = _mapping(value, flag)
        if data is not None:
            options[key] = data
    try:
        return check_actor_options(options)
    except LoomrayUserError as e:
        raise CliError(str(e)) from e


def actor_options_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--actor-options``, ``--resources`` and ``--runtime-env`` to a command."""
    flags = [
        click.option("--actor-options", "actor_options", default=None, metavar="JSON|@FILE",
                     help='Ray actor options of the sessions, e.g. \'{"num_cpus": 1, "memory": 2e9}\'.'),
        click.option("--resources", default=None, metavar="JSON|@FILE",
                     help='Custom resources a session needs, e.g. \'{"loomray_session": 1}\': sessions run only '
                          "on nodes that have them, and an autoscaler scales on them."),
        click.option("--runtime-env", "runtime_env", default=None, metavar="JSON|@FILE",
                     help="Ray runtime_env of the sessions (pip, env_vars, working_dir, ...)."),
    ]
    for flag in reversed(flags):
        command = flag(command)
    return command
