"""Model name resolution: names to adapters, and clear errors when the Agent is built."""

import importlib.util
import sys

import pytest

from loomray.errors import LoomrayUserError, ModelConfigError
from loomray.models.names import provider_for
from loomray.models.resolve import resolve_model
from loomray.models.scripted import ScriptedModel

needs_anthropic = pytest.mark.skipif(
    importlib.util.find_spec("anthropic") is None,
    reason="the anthropic SDK is not installed: pip install 'loomray[anthropic]'")
needs_openai = pytest.mark.skipif(
    importlib.util.find_spec("openai") is None,
    reason="the openai SDK is not installed: pip install 'loomray[openai]'")


@pytest.fixture
def no_keys(monkeypatch):
    for var in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY", "LOOMRAY_PRICES"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("name, expected", [
    ("claude-opus-4-7", ("anthropic", "claude-opus-4-7")),
    ("claude-haiku-4-5-20251001", ("anthropic", "claude-haiku-4-5-20251001")),
    ("gpt-4o", ("openai", "gpt-4o")),
    ("gpt-5.4-mini", ("openai", "gpt-5.4-mini")),
    ("o3", ("openai", "o3")),
    ("o4-mini", ("openai", "o4-mini")),
    ("openai:llama-3.1-70b", ("openai", "llama-3.1-70b")),
    ("Anthropic:claude-sonnet-4-6", ("anthropic", "claude-sonnet-4-6")),
    ("openai:ft:gpt-4o:acme::abc", ("openai", "ft:gpt-4o:acme::abc")),
])
def test_provider_for(name, expected):
    assert provider_for(name) == expected


@pytest.mark.parametrize("name", ["llama-3", "mistral-large", "omni", "", "  ", "openai:"])
def test_unknown_or_empty_name_is_a_config_error(name):
    with pytest.raises(ModelConfigError):
        resolve_model(name)


def test_unknown_provider_prefix_is_a_config_error():
    with pytest.raises(ModelConfigError, match="unknown model provider 'gemini'"):
        resolve_model("gemini:gemini-3-pro")


def test_config_errors_are_user_errors():
    assert issubclass(ModelConfigError, LoomrayUserError) and issubclass(ModelConfigError, ValueError)


def test_model_instance_passes_through_and_other_types_fail():
    model = ScriptedModel(["hi"])
    assert resolve_model(model) is model
    with pytest.raises(TypeError):
        resolve_model(42)


@needs_anthropic
def test_missing_anthropic_key_fails_at_resolve(no_keys):
    with pytest.raises(ModelConfigError, match="ANTHROPIC_API_KEY") as info:
        resolve_model("claude-opus-4-7")
    assert "claude-opus-4-7" in str(info.value)


@needs_openai
def test_missing_openai_key_fails_at_resolve(no_keys):
    with pytest.raises(ModelConfigError, match="OPENAI_API_KEY"):
        resolve_model("gpt-4o")


def test_missing_extra_fails_at_resolve_with_install_hint(no_keys):
    no_keys.setenv("ANTHROPIC_API_KEY", "k")
    no_keys.setitem(sys.modules, "anthropic", None)  # makes `import anthropic` raise ImportError
    with pytest.raises(ModelConfigError, match=r"pip install 'loomray\[anthropic\]'"):
        resolve_model("claude-opus-4-7")


@needs_anthropic
@needs_openai
def test_resolved_adapters_carry_settings_and_names_that_resolve_back(no_keys):
    no_keys.setenv("ANTHROPIC_API_KEY", "k")
    no_keys.setenv("OPENAI_API_KEY", "k")
    claude = resolve_model("claude-opus-4-7", base_url="http://127.0.0.1:9", max_retries=1, timeout=5)
    assert (type(claude).__name__, claude.name, claude.base_url, claude.max_retries) == (
        "AnthropicModel", "claude-opus-4-7", "http://127.0.0.1:9", 1)
    local = resolve_model("openai:llama-3.1-70b", base_url="http://127.0.0.1:9/v1")
    assert local.name == "openai:llama-3.1-70b"  # a checkpoint's model name resolves to the same adapter
    assert provider_for(local.name) == ("openai", "llama-3.1-70b")


@needs_openai
def test_bad_settings_are_config_errors(no_keys):
    no_keys.setenv("OPENAI_API_KEY", "k")
    with pytest.raises(ModelConfigError, match="max_retries"):
        resolve_model("gpt-4o", max_retries=-1)
    with pytest.raises(ModelConfigError, match="timeout"):
        resolve_model("gpt-4o", timeout=0)
    with pytest.raises(TypeError):
        resolve_model("gpt-4o", temprature=0.2)  # a typo'd setting is not silently ignored
