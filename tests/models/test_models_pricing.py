"""The price table: data in one file, overridable, and never a guess."""

import json
from datetime import datetime, timezone

import genai_prices
import pytest

from loomray.errors import ModelConfigError
from loomray.models.pricing import MAINTAINED_SOURCE, PRICES_ENV, Price, PriceTable, load_prices
from loomray.records import Usage


@pytest.fixture(autouse=True)
def no_env_prices(monkeypatch):
    monkeypatch.delenv(PRICES_ENV, raising=False)
    return monkeypatch


def test_known_models_are_priced_by_genai_prices_and_name_their_source():
    table = load_prices()
    usage = Usage(input_tokens=1_000_000, output_tokens=1_000_000)
    assert table.quote("anthropic", "claude-opus-4-7", usage)[0] == pytest.approx(30.0)
    assert table.quote("openai", "gpt-4o", usage)[0] == pytest.approx(12.5)
    cost, source = table.quote("openai", "gpt-4o", usage)
    assert source == MAINTAINED_SOURCE == f"genai-prices {genai_prices.__version__}"


def test_a_price_change_by_date_prices_each_call_at_its_own_date():
    # Claude Sonnet 4.6 had a long-context tier until 2026-03-12 and flat prices from 2026-03-13.
    table = load_prices()
    long_prompt = Usage(input_tokens=300_000, output_tokens=1_000)
    before = table.quote("anthropic", "claude-sonnet-4-6", long_prompt, at=datetime(2026, 3, 1, tzinfo=timezone.utc))[0]
    after = table.quote("anthropic", "claude-sonnet-4-6", long_prompt, at=datetime(2026, 3, 20, tzinfo=timezone.utc))[0]
    assert before == pytest.approx((300_000 * 6 + 1_000 * 22.5) / 1e6)
    assert after == pytest.approx((300_000 * 3 + 1_000 * 15) / 1e6)


def test_a_long_context_tier_bills_the_whole_prompt_at_its_rate():
    # GPT-5.4 bills prompts over 272,000 tokens at its long-context rates.
    table = load_prices()
    short = table.quote("openai", "gpt-5.4", Usage(input_tokens=200_000, output_tokens=1_000))[0]
    long = table.quote("openai", "gpt-5.4", Usage(input_tokens=300_000, output_tokens=1_000))[0]
    assert short == pytest.approx((200_000 * 2.5 + 1_000 * 15) / 1e6)
    assert long == pytest.approx((300_000 * 5 + 1_000 * 22.5) / 1e6)


def test_unknown_model_costs_none_never_a_guess():
    table = load_prices()
    usage = Usage(input_tokens=10, output_tokens=10)
    assert table.quote("anthropic", "claude-unreleased-9", usage)[0] is None
    assert table.quote("mystery", "gpt-4o", usage)[0] is None
    assert table.quote("anthropic", "claude-unreleased-9", usage) == (None, None)


def test_dated_snapshot_uses_its_alias_but_no_other_fuzzy_match():
    table = PriceTable.from_data({"prices": {"openai": {"gpt-4o": {"input": 1, "output": 2}}}}, source="t")
    usage = Usage(input_tokens=1_000_000)
    assert table.quote("openai", "gpt-4o-2024-08-06", usage)[0] == pytest.approx(1.0)
    # the override of gpt-4o never reaches gpt-4o-mini, which keeps its own maintained price
    assert table.quote("openai", "gpt-4o-mini", usage) == (pytest.approx(0.15), MAINTAINED_SOURCE)
    assert table.quote("openai", "my-model-mini", usage)[0] is None


def test_cache_tokens_are_priced_as_parts_of_the_input():
    price = Price(input=4.0, output=10.0, cache_read=0.4, cache_write=5.0)
    usage = Usage(input_tokens=1000, cache_read_tokens=600, cache_write_tokens=300, output_tokens=50)
    assert price.cost(usage) == pytest.approx((100 * 4.0 + 600 * 0.4 + 300 * 5.0 + 50 * 10.0) / 1e6)


def test_a_used_category_without_a_price_makes_the_cost_unknown():
    price = Price(input=1.0, output=2.0)  # no cache prices known
    assert price.cost(Usage(input_tokens=10, output_tokens=1)) == pytest.approx(12 / 1e6)
    assert price.cost(Usage(input_tokens=10, cache_read_tokens=5)) is None
    assert price.cost(Usage(input_tokens=10, cache_write_tokens=5)) is None


def test_env_file_overrides_genai_prices_and_argument_overrides_env(tmp_path, no_env_prices):
    env_file = tmp_path / "prices.json"
    env_file.write_text(json.dumps({"prices": {
        "anthropic": {"claude-opus-4-7": {"input": 1, "output": 1, "cache_read": 0, "cache_write": 0}},
        "openai": {"my-finetune": {"input": 2, "output": 2}},
    }}))
    no_env_prices.setenv(PRICES_ENV, str(env_file))
    usage = Usage(input_tokens=1_000_000)

    table = load_prices()
    assert table.quote("anthropic", "claude-opus-4-7", usage)[0] == pytest.approx(1.0)
    assert table.quote("openai", "my-finetune", usage)[0] == pytest.approx(2.0)
    assert table.quote("openai", "gpt-4o", usage)[0] == pytest.approx(2.5)  # untouched models keep genai-prices
    assert table.quote("openai", "my-finetune", usage)[1] == f"override: {env_file}"

    table = load_prices({"prices": {"openai": {"my-finetune": {"input": 3, "output": 3}}}})
    assert table.quote("openai", "my-finetune", usage)[0] == pytest.approx(3.0)
    assert table.quote("anthropic", "claude-opus-4-7", usage)[0] == pytest.approx(1.0)

    assert load_prices(env_file) == load_prices()  # a path works as the argument too
    assert table.quote("openai", "my-finetune", usage)[1] == "override: prices= argument"
    again = PriceTable.from_data(table.to_data(), source="pickled")  # what an adapter ships to a Ray actor
    assert again == table and again.quote("openai", "my-finetune", usage)[1] == "override: prices= argument"


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
    priced = model.priced(Usage(input_tokens=5, output_tokens=5))
    assert priced.cost_usd == 0.0 and priced.price_source == "override: prices= argument"
    assert OpenAIModel("local-llama").priced(Usage(input_tokens=5)).cost_usd is None
    assert OpenAIModel("gpt-4o").priced(Usage(input_tokens=5)).price_source == MAINTAINED_SOURCE


def test_sums_of_usage_keep_one_source_or_say_mixed():
    a = Usage(input_tokens=1, cost_usd=0.1, price_source="genai-prices 0.2.3")
    b = Usage(input_tokens=1, cost_usd=0.2, price_source="override: prices= argument")
    assert (Usage() + a + a).price_source == "genai-prices 0.2.3"
    assert (a + b).price_source == "mixed"
    assert (Usage() + Usage()).price_source is None
