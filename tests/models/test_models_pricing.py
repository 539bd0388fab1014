"""The price table: data in one file, overridable, and never a guess."""

import json

import pytest

from loomray.errors import ModelConfigError
from loomray.models.pricing import PRICES_ENV, Price, PriceTable, load_prices
from loomray.records import Usage


@pytest.fixture(autouse=True)
def no_env_prices(monkeypatch):
    monkeypatch.delenv(PRICES_ENV, raising=False)
    return monkeypatch


def test_builtin_table_loads_and_prices_known_models():
    table = load_prices()
    usage = Usage(input_tokens=1_000_000, output_tokens=1_000_000)
    assert table.cost("anthropic", "claude-opus-4-7", usage) == pytest.approx(30.0)
    assert table.cost("openai", "gpt-4o", usage) == pytest.approx(12.5)


def test_every_builtin_entry_is_complete():
    data = PriceTable.builtin().to_data()["prices"]
    assert set(data) == {"anthropic", "openai"}
    for provider, models in data.items():
        for model, price in models.items():
            assert price["cache_read"] is not None and price["cache_write"] is not None, (provider, model)
            assert price["output"] >= price["input"] > 0, (provider, model)


def test_unknown_model_costs_none_never_a_guess():
    table = load_prices()
    usage = Usage(input_tokens=10, output_tokens=10)
    assert table.cost("anthropic", "claude-unreleased-9", usage) is None
    assert table.cost("mystery", "gpt-4o", usage) is None


def test_dated_snapshot_uses_its_alias_but_no_other_fuzzy_match():
    table = PriceTable.from_data({"prices": {"openai": {"gpt-4o": {"input": 1, "output": 2}}}}, source="t")
    usage = Usage(input_tokens=1_000_000)
    assert table.cost("openai", "gpt-4o-2024-08-06", usage) == pytest.approx(1.0)
    assert table.cost("openai", "gpt-4o-mini", usage) is None
    assert table.cost("openai", "gpt-4o-mini-2024-07-18", usage) is None


def test_cache_tokens_are_priced_as_parts_of_the_input():
    price = Price(input=4.0, output=10.0, cache_read=0.4, cache_write=5.0)
    usage = Usage(input_tokens=1000, cache_read_tokens=600, cache_write_tokens=300, output_tokens=50)
    assert price.cost(usage) == pytest.approx((100 * 4.0 + 600 * 0.4 + 300 * 5.0 + 50 * 10.0) / 1e6)


def test_a_used_category_without_a_price_makes_the_cost_unknown():
    price = Price(input=1.0, output=2.0)  # no cache prices known
    assert price.cost(Usage(input_tokens=10, output_tokens=1)) == pytest.approx(12 / 1e6)
    assert price.cost(Usage(input_tokens=10, cache_read_tokens=5)) is None
    assert price.cost(Usage(input_tokens=10, cache_write_tokens=5)) is None


def test_env_file_overrides_builtin_and_argument_overrides_env(tmp_path, no_env_prices):
    env_file = tmp_path / "prices.json"
    env_file.write_text(json.dumps({"prices": {
        "anthropic": {"claude-opus-4-7": {"input": 1, "output": 1, "cache_read": 0, "cache_write": 0}},
        "openai": {"my-finetune": {"input": 2, "output": 2}},
    }}))
    no_env_prices.setenv(PRICES_ENV, str(env_file))
    usage = Usage(input_tokens=1_000_000)

    table = load_prices()
    assert table.cost("anthropic", "claude-opus-4-7", usage) == pytest.approx(1.0)
    assert table.cost("openai", "my-finetune", usage) == pytest.approx(2.0)
    assert table.cost("openai", "gpt-4o", usage) == pytest.approx(2.5)  # untouched entries stay

    table = load_prices({"prices": {"openai": {"my-finetune": {"input": 3, "output": 3}}}})
    assert table.cost("openai", "my-finetune", usage) == pytest.approx(3.0)
    assert table.cost("anthropic", "claude-opus-4-7", usage) == pytest.approx(1.0)

    assert load_prices(env_file) == load_prices()  # a path works as the argument too


@pytest.mark.parametrize("content, match", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"anthropic": {}}', 'expected a "prices" object'),
    ('{"prices": {"openai": {"gpt-4o": {"input": -1, "output": 1}}}}', "prices.openai.gpt-4o"),
    ('{"prices": {"openai": {"gpt-4o": {"inptu": 1, "output": 1}}}}', "prices.openai.gpt-4o"),
])
def test_bad_price_file_is_a_config_error_naming_it(tmp_path, no_env_prices, content, match):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    no_env_prices.setenv(PRICES_ENV, str(bad))
    with pytest.raises(ModelConfigError, match=match) as info:
        load_prices()
    assert "bad.json" in str(info.value)


def test_missing_price_file_and_wrong_argument_type_are_config_errors(tmp_path):
    with pytest.raises(ModelConfigError, match="cannot read price table"):
        load_prices(tmp_path / "nope.json")
    with pytest.raises(ModelConfigError, match="prices must be"):
        load_prices(3.5)


@pytest.mark.skipif(__import__("importlib").util.find_spec("openai") is None, reason="openai SDK not installed")
def test_adapter_takes_prices_argument(monkeypatch):
    from loomray.models.openai import OpenAIModel

    monkeypatch.setenv("OPENAI_API_KEY", "k")
    model = OpenAIModel("local-llama", prices={"prices": {"openai": {"local-llama": {
        "input": 0, "output": 0, "cache_read": 0, "cache_write": 0}}}})
    assert model.priced(Usage(input_tokens=5, output_tokens=5)).cost_usd == 0.0
    assert OpenAIModel("local-llama").priced(Usage(input_tokens=5)).cost_usd is None
