"""Secrets never reach the store with a session's actor options, and an adopted session still gets them.

An API key in ``runtime_env.env_vars`` (what docs/providers.md used to suggest)
was written in plaintext to ``active/{user}/{session}.json``.
"""

import json
import logging

import pytest

pytest.importorskip("ray")

from loomray.errors import LoomrayUserError  # noqa: E402
from loomray.runtime import active  # noqa: E402
from loomray.runtime.actors import RuntimeConfig, check_actor_options  # noqa: E402
from loomray.runtime.adoption import AdoptionPolicy  # noqa: E402
from loomray.runtime.stored_options import looks_secret  # noqa: E402

MARKER = "sk-ant-MARKER-7f3a9c"


def _options(**env):
    return {"resources": {"loomray_session": 1}, "runtime_env": {"env_vars": env}}


@pytest.mark.parametrize("name, value, secret", [
    ("ANTHROPIC_API_KEY", "anything", True),
    ("GITHUB_TOKEN", "x", True),
    ("DB_PASSWORD", "x", True),
    ("AWS_SECRET_ACCESS_KEY", "x", True),
    ("HARMLESS", MARKER, True),  # a provider key's shape, whatever its name
    ("HARMLESS", "AKIAIOSFODNN7EXAMPLE", True),
    ("ANTHROPIC_API_KEY", "${ANTHROPIC_API_KEY}", False),  # expanded by Ray on the node
    ("LOG_LEVEL", "debug", False),
    ("PYTHONPATH", "/opt/agents", False),
])
def test_secret_looking_env_vars(name, value, secret):
    assert looks_secret(name, value) is secret


def test_an_active_mark_never_holds_a_secret_env_var(tmp_path):
    options = _options(ANTHROPIC_API_KEY=MARKER, OPENAI_API_KEY="${OPENAI_API_KEY}", LOG_LEVEL="debug")
    body = active.note("actor", options)
    assert MARKER.encode() not in body
    mark = json.loads(body)
    assert mark["secret_env_vars"] == ["ANTHROPIC_API_KEY"]
    assert mark["actor_options"] == _options(OPENAI_API_KEY="${OPENAI_API_KEY}", LOG_LEVEL="debug")
    assert options["runtime_env"]["env_vars"]["ANTHROPIC_API_KEY"] == MARKER  # the caller's options untouched


def test_an_adopted_session_gets_left_out_secrets_from_the_supervisors_own_options(tmp_path, caplog):
    mark = json.loads(active.note("actor", _options(ANTHROPIC_API_KEY=MARKER, LOG_LEVEL="debug")))
    own = RuntimeConfig(store_url=str(tmp_path), actor_options={"runtime_env": {"env_vars": {"ANTHROPIC_API_KEY": "k2"}}})
    config = AdoptionPolicy(own, store=None).config_for(mark)
    assert config.actor_options == _options(ANTHROPIC_API_KEY="k2", LOG_LEVEL="debug")

    bare = RuntimeConfig(store_url=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="loomray.runtime.adoption"):
        config = AdoptionPolicy(bare, store=None).config_for(mark)
    # Restarted without it: the worker sees the node's environment; the operator is told which ones.
    assert config.actor_options == _options(LOG_LEVEL="debug")
    assert "ANTHROPIC_API_KEY" in caplog.text and MARKER not in caplog.text


def test_a_refused_option_does_not_print_the_secret():
    with pytest.raises(LoomrayUserError) as e:
        check_actor_options({"bogus": 1, "runtime_env": {"env_vars": {"ANTHROPIC_API_KEY": MARKER}}})
    assert MARKER not in str(e.value) and "<redacted>" in str(e.value)


def test_a_forged_mark_cannot_choose_what_code_an_adopted_session_runs(tmp_path, caplog):
    """Whoever can write a user's prefix writes its marks: placement may come from there, code may not."""
    forged = {"v": 1, "placement": "actor", "since": "2026-07-04T00:00:00+00:00", "actor_options": {
        "resources": {"loomray_session": 1}, "num_cpus": 0.5,
        "runtime_env": {"pip": ["evil-package"], "working_dir": "s3://evil/code.zip", "py_modules": ["s3://evil/m.zip"],
                        "worker_process_setup_hook": "evil:hook", "config": {"setup_timeout_seconds": 60},
                        "env_vars": {"LOG_LEVEL": "debug", "PYTHONPATH": "/tmp/evil", "LD_PRELOAD": "/tmp/evil.so"}}}}
    own = RuntimeConfig(store_url=str(tmp_path), actor_options={"runtime_env": {"config": {"setup_timeout_seconds": 60},
                                                                                "pip": ["requests"]}})
    with caplog.at_level(logging.WARNING, logger="loomray.runtime.adoption"):
        config = AdoptionPolicy(own, store=None).config_for(forged)
    assert config.actor_options == {
        "resources": {"loomray_session": 1}, "num_cpus": 0.5,
        "runtime_env": {"pip": ["requests"], "config": {"setup_timeout_seconds": 60}, "env_vars": {"LOG_LEVEL": "debug"}}}
    for refused in ("runtime_env.pip", "runtime_env.working_dir", "runtime_env.py_modules",
                    "runtime_env.worker_process_setup_hook", "env_vars.PYTHONPATH", "env_vars.LD_PRELOAD"):
        assert refused in caplog.text
