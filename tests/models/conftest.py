"""Fixtures: fake provider APIs on 127.0.0.1 (see model_wire.py)."""

import pytest
from model_wire import API_KEY, WireServer


@pytest.fixture
def anthropic_server(monkeypatch):
    """A fake Anthropic API, with ANTHROPIC_API_KEY set to the key it accepts."""
    for var in ("ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_PROFILE", "LOOMRAY_PRICES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ANTHROPIC_API_KEY", API_KEY)
    server = WireServer("anthropic")
    yield server
    server.close()


@pytest.fixture
def openai_server(monkeypatch):
    """A fake OpenAI API, with OPENAI_API_KEY set to the key it accepts."""
    for var in ("OPENAI_BASE_URL", "OPENAI_ORG_ID", "OPENAI_PROJECT_ID", "LOOMRAY_PRICES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    server = WireServer("openai")
    yield server
    server.close()
