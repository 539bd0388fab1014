"""What a run leaves in the bucket is readable without loomray: boto3 + json for checkpoints, pyarrow for the index."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.fs as pafs

from loomray import Agent, Tuning
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime


def lookup(key: str) -> str:
    """Look something up."""
    return f"value of {key}: " + "é" * 100


def _agent(runtime):
    model = ScriptedModel([{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(3)] + ["done"])
    return Agent("sys", model=model, tools=[lookup], runtime=runtime, tuning=Tuning(checkpoint=True))


async def test_s3_objects_are_plain_json_and_the_index_is_parquet(s3_server):
    bucket = s3_server.new_bucket("fmt")
    runtime = LocalRuntime(f"s3://{bucket}/root", **s3_server.options)
    result = await _agent(runtime).run("task", session_id="research-2026-07-04", user_id="alice")
    runtime.close()

    s3 = s3_server.client()
    prefix = "root/sessions/alice/research-2026-07-04/checkpoints/"
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"])
    assert len(keys) == 4 and keys[-1] == f"{prefix}{result.checkpoint_id}.json"
    body = s3.get_object(Bucket=bucket, Key=keys[-1])["Body"].read()
    doc = json.loads(body)  # jq-compatible: one self-describing JSON object (its index row first, a digest last)
    assert doc["schema_version"] == "2.0" and doc["index"]["execution_status"] == "completed"
    assert doc["index"]["turn"] == 4 and doc["index"]["chain"]  # what it builds on, oldest first
    assert [m["content"] for m in doc["messages"]] == ["done"]  # only what the last pass added
    assert doc["keep"] == len(result.messages) - 1 and len(doc["sha256"]) == 64
    # Read back whole without loomray: each object keeps `keep` messages of the one before it, then adds its own.
    def links(entry: str) -> list[str]:  # "first..last": consecutive links, numbered by their last 6 hex digits
        first, _, last = entry.partition("..")
        if not last:
            return [first]
        return [f"{first[:-6]}{n:06x}" for n in range(int(first[-6:], 16), int(last[-6:], 16) + 1)]

    messages: list = []
    for link in [*(x for e in doc["index"]["chain"] for x in links(e)), None]:
        part = doc if link is None else json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}{link}.json")["Body"].read())
        messages = messages[:part["keep"]] + part["messages"]
    assert messages == [m.model_dump(mode="json") for m in result.messages]
    journal = s3.list_objects_v2(Bucket=bucket, Prefix="root/sessions/alice/research-2026-07-04/journal/")
    entries = [json.loads(s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()) for o in journal["Contents"]]
    # A pass's tool result is in the checkpoint written right after it: the journal holds the model answers.
    assert {e["kind"] for e in entries} == {"run_start", "model", "run_end"}
    assert all(e["type"] == "journal_entry" for e in entries)

    fs = pafs.S3FileSystem(endpoint_override=s3_server.endpoint_url, access_key="testing", secret_key="testing",
                           region="us-east-1", scheme="http")
    table = ds.dataset(f"{bucket}/root/index/checkpoints", filesystem=fs, format="parquet",
                       partitioning="hive").to_table()
    rows = [r for r in table.to_pylist() if r["checkpoint_id"] == result.checkpoint_id]
    assert rows and rows[0]["turn"] == 4 and rows[0]["execution_status"] == "completed"
    assert rows[0]["input_tokens"] == result.usage.input_tokens


async def test_local_directory_layout_is_readable_with_json_and_pyarrow(tmp_path):
    runtime = LocalRuntime(tmp_path / "data")
    result = await _agent(runtime).run("task", session_id="s1")
    path = tmp_path / "data" / "sessions" / "_" / "s1" / "checkpoints" / f"{result.checkpoint_id}.json"
    assert json.loads(path.read_text())["index"]["turn"] == 4
    table = ds.dataset(tmp_path / "data" / "index" / "checkpoints", format="parquet", partitioning="hive").to_table()
    assert result.checkpoint_id in table.column("checkpoint_id").to_pylist()
    sessions = ds.dataset(tmp_path / "data" / "index" / "sessions", format="parquet", partitioning="hive").to_table()
    statuses = [r["status"] for r in sessions.to_pylist() if r["session_id"] == "s1"]
    assert sorted(statuses) == ["completed", "running"]


def test_importing_and_running_the_loop_never_imports_ray():
    code = (
        "import sys, asyncio\n"
        "from loomray import Agent\n"
        "from loomray.models import ScriptedModel\n"
        "from loomray.runtime import InProcRuntime\n"
        "Agent('', model=ScriptedModel(['x']), runtime=InProcRuntime()).run_sync('go')\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
        "import loomray.loop, loomray.journal, loomray.session\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_loop_and_journal_do_not_import_storage_or_ray():
    root = Path(__file__).resolve().parents[2] / "loomray"
    loop_modules = tuple(f"loop/{p.name}" for p in sorted((root / "loop").glob("*.py")))
    assert "loop/run.py" in loop_modules
    for name in (*loop_modules, "journal.py", "tools.py", "condense.py", "events.py", "config.py"):
        text = (root / name).read_text()
        assert "import ray" not in text and "from ray" not in text
        assert "loomray.storage" not in text and "import storage" not in text, name
