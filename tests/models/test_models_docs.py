"""Every snippet of docs/providers.md runs, against the local provider servers."""

import re
from pathlib import Path

import pytest

pytest.importorskip("anthropic", reason="the anthropic SDK is not installed: pip install 'loomray[anthropic]'")
pytest.importorskip("openai", reason="the openai SDK is not installed: pip install 'loomray[openai]'")

from model_wire import anthropic_message  # noqa: E402

from loomray.models.pricing import PriceTable  # noqa: E402
from loomray.records import Usage  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "providers.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_doc_has_the_snippets_this_test_runs():
    assert len(blocks("python")) == 2 and len(blocks("json")) == 1
    assert "ANTHROPIC_API_KEY=sk-ant-... loomray demo --model claude-opus-4-7" in DOC.read_text()


def test_quick_start_snippet_runs(anthropic_server, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", anthropic_server.base_url)  # the SDK's own variable
    anthropic_server.reply(anthropic_message("Because starting over is expensive.",
                                             usage={"input_tokens": 40, "output_tokens": 9}))

    exec(compile(blocks("python")[0], str(DOC), "exec"), {})

    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Because starting over is expensive."
    assert out[1].startswith("40 9 ") and float(out[1].split()[2]) > 0
    assert (tmp_path / "loomray-data").is_dir()
    assert anthropic_server.requests[0]["body"]["model"] == "claude-opus-4-7"


def test_settings_snippet_runs(monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    monkeypatch.delenv("LOOMRAY_PRICES", raising=False)
    scope: dict = {}
    exec(compile(blocks("python")[1], str(DOC), "exec"), scope)
    assert capsys.readouterr().out.strip() == "openai:llama3.1"
    model = scope["model"]
    assert (model.base_url, model.max_retries, model.timeout, model.max_tokens) == (
        "http://127.0.0.1:11434/v1", 2, 60.0, 4096)
    assert model.prices.quote("openai", "llama3.1", Usage(input_tokens=1))[1].startswith("override: ")


def test_price_file_snippet_is_a_valid_table():
    import json

    table = PriceTable.from_data(json.loads(blocks("json")[0]), source="docs/providers.md")
    assert table.quote("openai", "my-finetune", Usage(output_tokens=1_000_000))[0] == 12.0
