"""The actor options a session's active mark keeps: JSON only, and never a secret.

Whoever can read the bucket reads the mark, so a secret-looking environment variable is left out and only
its name recorded; an adopting supervisor fills it from its own options (:func:`restore_secrets`).
docs/tenancy.md, "Secrets and stored actor options".
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

#: Names of environment variables that hold credentials by convention.
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|PWD|CREDENTIAL|AUTH|PRIVATE|COOKIE|SIGNATURE|DSN|CONN_STR",
                          re.IGNORECASE)
#: Values that are credentials whatever their name: provider keys, AWS access keys, PEM keys, bearer tokens.
_SECRET_VALUE = re.compile(r"^(sk-|sk_|rk_|pk_|AKIA|ASIA|ghp_|gho_|github_pat_|xox[abpr]-|glpat-|hf_|Bearer )"
                           r"|-----BEGIN [A-Z ]*PRIVATE KEY-----")
#: ``${VAR}``: Ray expands it from the node's environment, so it holds no secret itself.
_REFERENCE = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*\}$")
#: Stands for a left-out value in messages (never stored as a value: it would become the variable).
REDACTED = "<redacted>"


def looks_secret(name: str, value: object) -> bool:
    """Whether environment variable ``name=value`` looks like a credential (a ``${VAR}`` reference never does)."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if _REFERENCE.match(text):
        return False
    return bool(_SECRET_NAME.search(name) or _SECRET_VALUE.search(text))


def _env_vars(options: dict[str, Any]) -> dict[str, Any]:
    runtime_env = options.get("runtime_env")
    env = runtime_env.get("env_vars") if isinstance(runtime_env, dict) else None
    return env if isinstance(env, dict) else {}


def secret_env_names(options: dict[str, Any]) -> list[str]:
    """Names of the secret-looking variables in ``options["runtime_env"]["env_vars"]``, sorted."""
    return sorted(str(k) for k, v in _env_vars(options).items() if looks_secret(str(k), v))


def without_secrets(options: dict[str, Any], *, placeholder: str | None = None) -> dict[str, Any]:
    """A copy of ``options`` whose secret-looking env vars are left out (or, with ``placeholder``,
    replaced by it: for messages and logs)."""
    names = secret_env_names(options)
    if not names:
        return options
    out = copy.deepcopy(options)
    env = out["runtime_env"]["env_vars"]
    for name in names:
        if placeholder is None:
            del env[name]
        else:
            env[name] = placeholder
    return out


def storable_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options a session's mark stores: those that survive as JSON (resources, CPUs, memory, runtime
    env, labels), without secret-looking env vars. Objects such as a scheduling strategy stay behind
    (they cannot be stored, and name nodes that may be gone by then)."""
    kept = {}
    for k, v in without_secrets(options).items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        kept[k] = v
    return kept


def restore_secrets(stored: dict[str, Any], names: list[str], own: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``(options, missing)``: ``stored`` with each left-out variable of ``names`` filled from ``own`` (the
    adopting supervisor's actor options); ``missing`` are those ``own`` does not have either (the restarted
    worker then sees only what its node's environment holds)."""
    mine = _env_vars(own)
    found = {n: mine[n] for n in names if n in mine}
    missing = [n for n in names if n not in mine]
    if not found:
        return stored, missing
    out = copy.deepcopy(stored)
    runtime_env = out.setdefault("runtime_env", {})
    runtime_env.setdefault("env_vars", {}).update(found)
    return out, missing


#: Options an adopted session takes from its mark as stored: where it runs and with what resources.
_FROM_MARK = ("resources", "num_cpus", "num_gpus", "memory", "accelerator_type", "label_selector", "runtime_env")
#: Env vars that choose what code a worker loads: from a mark only when the supervisor's own options agree.
_CODE_ENV = re.compile(r"^(LD_|DYLD_|PYTHON|RAY_|LOOMRAY_)|^PATH$")


def trusted_options(stored: dict[str, Any], own: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``(options, dropped)``: what of a mark's stored options an adopting supervisor applies.

    Whoever can write a user's prefix can write its marks, and must not choose
    what code the cluster runs: from a mark come resources, CPUs, GPUs, memory,
    labels and plain ``env_vars``; anything else (``runtime_env`` ``pip``,
    ``working_dir``, ``py_modules``, ``worker_process_setup_hook``…, env vars
    such as ``PYTHONPATH`` or ``LD_PRELOAD``) only when it equals the
    supervisor's own (``own``), whose code settings otherwise apply.
    ``dropped`` names what was refused.
    """
    out, dropped = {}, []
    for k, v in stored.items():
        if k in _FROM_MARK or own.get(k) == v:
            out[k] = v
        else:
            dropped.append(k)
    env = out.get("runtime_env")
    if not isinstance(env, dict):
        return out, dropped
    own_runtime_env = own.get("runtime_env")
    own_env: dict[str, Any] = own_runtime_env if isinstance(own_runtime_env, dict) else {}
    kept: dict[str, Any] = {k: v for k, v in own_env.items() if k != "env_vars"}
    for k, v in env.items():
        if k == "env_vars" or own_env.get(k) == v:
            kept[k] = copy.deepcopy(v)
        else:
            dropped.append(f"runtime_env.{k}")
    env_vars, own_vars = kept.get("env_vars"), own_env.get("env_vars") or {}
    if isinstance(env_vars, dict):
        for name in [n for n, v in env_vars.items() if _CODE_ENV.match(str(n)) and own_vars.get(n) != v]:
            dropped.append(f"env_vars.{name}")
            del env_vars[name]
    out["runtime_env"] = kept
    return out, dropped
