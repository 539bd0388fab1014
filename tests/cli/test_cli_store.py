"""The store-side command line, end to end, as a new user types it (processes of ``loomray``).

Each command is its own process, forked from a server that imported loomray once (``tests/forked.py``):
the import every ``loomray`` command starts with, half a second each, paid once. The S3 credentials
test runs the console script itself.

Data comes from real runs of the offline research agent on a ``LocalRuntime``
in a temporary directory; ``LOOMRAY_STORE`` points at it. No Ray here.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from forked import run_loomray

REPO = Path(__file__).resolve().parents[2]
LOOMRAY = Path(sys.executable).with_name("loomray")
CMD = [str(LOOMRAY)] if LOOMRAY.exists() else [sys.executable, "-m", "loomray.cli"]
TURNS = 15  # demo:research with 14 passes + the report


def run_cli(*args: str, store: Path | None, timeout: float = 90, **env: str) -> subprocess.CompletedProcess:
    """``loomray ARGS`` with ``LOOMRAY_STORE`` set (or removed when ``store`` is None)."""
    e = {k: v for k, v in os.environ.items() if k not in ("LOOMRAY_STORE", "RAY_ADDRESS")}
    if store is not None:
        e["LOOMRAY_STORE"] = str(store)
    e["COLUMNS"] = "200"  # a wide terminal: rich tables are not cut at 80 columns
    e.update(env)
    return run_loomray(list(args), env=e, cwd=REPO, timeout=timeout)


def ok_json(out: subprocess.CompletedProcess) -> object:
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Three finished sessions: s-one and s-two (no user), s-one of user alice."""
    from loomray.cli.demo_agent import research_agent
    from loomray.runtime import LocalRuntime

    root = tmp_path_factory.mktemp("cli-store") / "store"
    agent = copy.copy(research_agent)
    agent.runtime = LocalRuntime(root)
    agent.run_sync("Durable agents", session_id="s-one")
    agent.run_sync("Parquet indexes", session_id="s-two")
    agent.run_sync("Leases", session_id="s-one", user_id="alice")
    agent.runtime.close()
    return root


def test_checkpoints_table_and_json(store):
    table = run_cli("checkpoints", "s-one", store=store)
    assert table.returncode == 0, table.stderr
    assert "checkpoints of s-one" in table.stdout and "completed" in table.stdout
    rows = ok_json(run_cli("checkpoints", "s-one", "--json", store=store))
    assert [r["turn"] for r in rows] == list(range(TURNS, 0, -1))  # newest first, one per pass
    assert rows[0]["execution_status"] == "completed" and rows[0]["user_id"] is None
    alice = ok_json(run_cli("checkpoints", "s-one", "--user", "alice", "--json", store=store))
    assert {r["user_id"] for r in alice} == {"alice"}
    assert {r["checkpoint_id"] for r in alice}.isdisjoint(r["checkpoint_id"] for r in rows)


def test_show_latest_and_one_checkpoint(store):
    data = ok_json(run_cli("show", "s-one", "--json", store=store))
    assert data["session_id"] == "s-one" and data["turn"] == TURNS and data["execution_status"] == "completed"
    assert data["messages"][-1]["content"].startswith("# Report: Durable agents")
    text = run_cli("show", "s-one", store=store)
    assert text.returncode == 0 and f"turn {TURNS}" in text.stdout and "assistant:" in text.stdout
    older = ok_json(run_cli("checkpoints", "s-one", "--json", store=store))[5]
    one = ok_json(run_cli("show", "s-one", older["checkpoint_id"], "--json", store=store))
    assert one["checkpoint_id"] == older["checkpoint_id"] and one["turn"] == older["turn"]


def test_query_with_filters(store):
    rows = ok_json(run_cli("query", "--session", "s-one", "--limit", "1000", "--json", store=store))
    assert len(rows) == 2 * TURNS and {r["session_id"] for r in rows} == {"s-one"}
    mine = ok_json(run_cli("query", "--user", "alice", "--json", store=store))
    assert len(mine) == TURNS and {r["user_id"] for r in mine} == {"alice"}
    done = ok_json(run_cli("query", "--status", "completed", "--json", store=store))
    assert sorted((r["user_id"] or "", r["session_id"]) for r in done) == [("", "s-one"), ("", "s-two"), ("alice", "s-one")]
    assert ok_json(run_cli("query", "--min-cost", "1000000", "--json", store=store)) == []
    table = run_cli("query", "--status", "completed", store=store)
    assert table.returncode == 0 and "3 rows" in table.stdout


def test_query_sql_over_checkpoints_and_sessions(store):
    sql = "select session_id, user_id, max(turn) as turns from checkpoints group by all order by user_id nulls first, session_id"
    rows = ok_json(run_cli("query", sql, "--json", store=store))
    assert rows == [{"session_id": "s-one", "user_id": None, "turns": TURNS},
                    {"session_id": "s-two", "user_id": None, "turns": TURNS},
                    {"session_id": "s-one", "user_id": "alice", "turns": TURNS}]
    sessions = ok_json(run_cli("query", "select status, count(*) as n from sessions group by 1", "--json", store=store))
    assert sessions == [{"status": "completed", "n": 3}]
    filtered = ok_json(run_cli("query", "select count(*) as n from checkpoints", "--user", "alice", "--json", store=store))
    assert filtered == [{"n": TURNS}]


def test_compact_then_prune(store, tmp_path):
    import shutil

    from loomray.storage import open_store

    mine = tmp_path / "store"
    shutil.copytree(store, mine)
    def files() -> int:
        st = open_store(mine)
        return len(st.index_files("checkpoints")) + len(st.index_files("sessions"))

    before = files()
    report = ok_json(run_cli("compact", "--json", store=mine))
    assert report["files_before"] == before and report["files_after"] < before
    assert files() == report["files_after"]
    assert len(ok_json(run_cli("query", "--limit", "1000", "--json", store=mine))) == 3 * TURNS

    refused = run_cli("prune", store=mine)
    assert refused.returncode == 2 and "--yes" in refused.stderr
    # Not a terminal, so nobody can be asked: without --yes, prune refuses even with a filter.
    refused = run_cli("prune", "--session", "s-two", store=mine)
    assert refused.returncode == 2 and "--yes" in refused.stderr and "not a terminal" in refused.stderr
    assert len(ok_json(run_cli("checkpoints", "s-two", "--json", store=mine))) == TURNS
    pruned = ok_json(run_cli("prune", "--session", "s-two", "--yes", "--json", store=mine))
    assert pruned["checkpoints"] == TURNS and pruned["journal_entries"] > 0
    assert ok_json(run_cli("checkpoints", "s-two", "--json", store=mine)) == []
    # Nothing else was touched.
    assert len(ok_json(run_cli("checkpoints", "s-one", "--json", store=mine))) == TURNS
    assert len(ok_json(run_cli("checkpoints", "s-one", "--user", "alice", "--json", store=mine))) == TURNS


def test_resume_and_fork_in_process_by_agent_reference(store, tmp_path):
    """Without a cluster, resume and fork run in this process; the reference is stored for next time."""
    import shutil

    mine = tmp_path / "store"
    shutil.copytree(store, mine)
    res = ok_json(run_cli("resume", "s-one", "Add a section on costs.", "--agent", "loomray.cli.demo_agent:research_agent",
                          "--json", store=mine))
    assert res["session_id"] == "s-one" and res["resumed_from_checkpoint"] is True
    assert res["turns"] == TURNS + 4 and res["model_calls"] == 4  # search, fetch, note, revised report
    assert "costs" in res["output"]
    base = ok_json(run_cli("checkpoints", "s-one", "--json", store=mine))[-1]  # the oldest kept
    forks = ok_json(run_cli("fork", "s-one", "--from", base["checkpoint_id"], "--prompt", "A?", "--prompt", "B?",
                            "--json", store=mine))  # no --agent: the reference stored by resume
    assert [f["prompt"] for f in forks] == ["A?", "B?"]
    assert len({f["session_id"] for f in forks}) == 2 and "s-one" not in {f["session_id"] for f in forks}
    for f in forks:
        ckpt = ok_json(run_cli("show", f["session_id"], "--json", store=mine))
        assert ckpt["forked_from"] == "s-one" and ckpt["execution_status"] == "completed"
        assert f["model_calls"] == TURNS - base["turn"]  # the rest of the plan; nothing before the fork point


@pytest.mark.parametrize("args, env, expected", [
    (["checkpoints", "a/b"], {}, "session_id"),
    (["checkpoints", "no-such-session"], {}, "unknown session 'no-such-session'"),
    (["show", "no-such-session"], {}, "unknown session 'no-such-session'"),
    (["show", "s-one", "ckpt-nope"], {}, "no checkpoint 'ckpt-nope'"),
    (["checkpoints", "s-one"], {"LOOMRAY_STORE": ""}, "no store given"),
    (["checkpoints", "s-one", "--store", "/nonexistent/loomray-store"], {}, "no store at"),
    (["query", "selec nonsense from checkpoints"], {}, "SQL error"),
    (["query", "select * from no_such_table"], {}, "SQL error"),
    (["query", "--since", "yesterday"], {}, "not a time"),
    (["resume", "no-such-session"], {}, "unknown session"),
    (["resume", "s-two"], {}, "no stored agent reference"),
    (["fork", "s-one", "--prompt", "x", "--agent", "no_such_module:agent"], {}, "cannot import agent reference"),
    (["submit", "no_such_module:agent", "hi", "--session", "s9"], {}, "cannot import agent reference"),
    (["submit", "loomray.cli.demo_agent:INSTRUCTIONS", "hi"], {}, "not a loomray Agent"),
    (["submit", "loomray.cli.demo_agent", "hi"], {}, "must look like"),
    (["submit", "examples.demo_agent:agent", "hi"], {}, "no Ray cluster given"),
    (["submit", "examples.demo_agent:agent", "hi", "--address", "127.0.0.1:1"], {}, "no Ray cluster answers"),
    (["demo", "--model", "claude-opus-4-7"], {"ANTHROPIC_API_KEY": "", "ANTHROPIC_AUTH_TOKEN": ""}, "ANTHROPIC"),
    (["demo", "--model", "nonsense-model"], {}, "cannot tell which provider"),
])
def test_user_mistakes_print_one_line_and_exit_nonzero(store, args, env, expected):
    out = run_cli(*args, store=store, **env)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error:") and expected in lines[0], lines[0]


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), out.stderr
    return lines[0]


def test_path04_lease_repair_rewrites_a_corrupt_or_missing_lease(store, tmp_path):
    import shutil

    mine = tmp_path / "store"
    shutil.copytree(store, mine)
    lease = mine / "sessions" / "_" / "s-one" / "lease.json"
    epoch = json.loads(lease.read_text())["epoch"]
    healthy = ok_json(run_cli("lease", "repair", "s-one", "--json", store=mine))
    assert (healthy["state"], healthy["repaired"], healthy["epoch"]) == ("ok", False, epoch)
    assert json.loads(lease.read_text())["epoch"] == epoch  # a healthy lease is left alone

    lease.write_bytes(b'{"epoch": 1e300}')
    fixed = ok_json(run_cli("lease", "repair", "s-one", "--json", store=mine))
    assert (fixed["state"], fixed["repaired"], fixed["epoch"]) == ("corrupt", True, epoch + 1)
    assert "lease.json" in fixed["problem"]
    assert json.loads(lease.read_text())["epoch"] == epoch + 1

    lease.unlink()
    text = run_cli("lease", "repair", "s-one", store=mine)
    assert text.returncode == 0 and "missing" in text.stdout and f"epoch {epoch + 2}" in text.stdout, text
    assert json.loads(lease.read_text())["epoch"] == epoch + 2
    again = run_cli("lease", "repair", "s-one", store=mine)
    assert again.returncode == 0 and "nothing to repair" in again.stdout

    assert "unknown session 'nobody'" in _one_error_line(run_cli("lease", "repair", "nobody", store=mine))
    assert "session_id" in _one_error_line(run_cli("lease", "repair", "a=b", store=mine))


def test_path10_checkpoints_quarantine_moves_a_bad_checkpoint_aside(store, tmp_path):
    import shutil

    mine = tmp_path / "store"
    shutil.copytree(store, mine)
    rows = ok_json(run_cli("checkpoints", "s-two", "--json", store=mine))
    newest = rows[0]
    path = mine / newest["key"]
    truncated = path.read_bytes()[:100]
    path.write_bytes(truncated)

    # "latest" falls back to the newest readable checkpoint, with a warning naming the bad one.
    shown = run_cli("show", "s-two", "--json", store=mine)
    assert json.loads(ok_json_text(shown))["checkpoint_id"] == rows[1]["checkpoint_id"]
    assert newest["checkpoint_id"] in shown.stderr

    moved = ok_json(run_cli("checkpoints", "quarantine", "s-two", newest["checkpoint_id"], "--json", store=mine))
    assert moved["quarantine_key"] == f"sessions/_/s-two/quarantine/{newest['checkpoint_id']}.json"
    assert (mine / moved["quarantine_key"]).read_bytes() == truncated and not path.exists()
    after = ok_json(run_cli("checkpoints", "s-two", "--json", store=mine))  # the plain listing still works
    assert [r["checkpoint_id"] for r in after] == [r["checkpoint_id"] for r in rows[1:]]
    shown = run_cli("show", "s-two", "--json", store=mine)
    assert json.loads(ok_json_text(shown))["checkpoint_id"] == rows[1]["checkpoint_id"] and not shown.stderr.strip()

    text = run_cli("checkpoints", "quarantine", "s-two", rows[1]["checkpoint_id"], store=mine)
    assert text.returncode == 0 and "quarantined" in text.stdout, text
    assert "ckpt-nope" in _one_error_line(run_cli("checkpoints", "quarantine", "s-two", "ckpt-nope", store=mine))


def ok_json_text(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return out.stdout


# --------------------------------------------------------------------- S3: credential errors and region


def _no_aws_credentials(env: dict[str, str], home: Path) -> dict[str, str]:
    """``env`` without any way to find AWS credentials (no keys, no profile files, no instance metadata)."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_DEFAULT_PROFILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        env.pop(var, None)
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(home / "none-credentials"), AWS_CONFIG_FILE=str(home / "none-config"),
               AWS_EC2_METADATA_DISABLED="true", HOME=str(home))
    return env


def test_s3_missing_credentials_is_one_clear_line_not_a_retry_story(s3_store_url, tmp_path):
    env = _no_aws_credentials(dict(os.environ), tmp_path)  # the endpoint (AWS_ENDPOINT_URL) stays
    env.pop("LOOMRAY_STORE", None)
    out = subprocess.run([*CMD, "checkpoints", "s-one", "--store", s3_store_url], capture_output=True, text=True,
                         timeout=90, env=env, cwd=REPO)
    line = _one_error_line(out)
    assert "no AWS credentials found" in line and "AWS_ACCESS_KEY_ID" in line and "AWS_PROFILE" in line
    assert "retries" not in line and s3_store_url.split("/")[2] in line


def test_s3_missing_credentials_raise_a_typed_error_at_once(s3_server, monkeypatch, tmp_path):
    from loomray.storage.errors import StorageError, TransientStorageError
    from loomray.storage.s3 import S3CredentialsError, S3ObjectStore

    for var, value in _no_aws_credentials({}, tmp_path).items():
        monkeypatch.setenv(var, value)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    objects = S3ObjectStore(s3_server.new_bucket(), "root", endpoint_url=s3_server.endpoint_url, max_attempts=5)
    sent: list[str] = []
    objects.client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url))
    with pytest.raises(S3CredentialsError) as info:
        list(objects.list(prefix="sessions/"))
    assert isinstance(info.value, StorageError) and not isinstance(info.value, TransientStorageError)
    assert "LIST not sent: no AWS credentials found" in str(info.value) and sent == []
    with pytest.raises(S3CredentialsError, match="PUT not sent"):
        objects.put(key="k", data=b"x")
    import pickle

    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)  # crosses a Ray actor boundary


class _Body:
    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_):
        yield self._data


@pytest.mark.parametrize("status, code, words", [
    (403, "InvalidAccessKeyId", "access key id is not known"),
    (403, "SignatureDoesNotMatch", "secret access key is wrong"),
    (403, "AccessDenied", "s3:ListBucket"),
    (400, "ExpiredToken", "session token has expired"),
])
def test_s3_refused_credentials_surface_at_once_unretried(s3_server, status, code, words):
    from botocore.awsrequest import AWSResponse

    from loomray.storage.s3 import S3CredentialsError

    store = s3_server.open_store(max_attempts=5)
    sent: list[str] = []

    def refuse(request, **_):
        sent.append(request.url)
        body = f"<Error><Code>{code}</Code><Message>refused</Message></Error>".encode()
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Body(body))

    store.objects.client.meta.events.register("before-send.s3", refuse)
    try:
        with pytest.raises(S3CredentialsError) as info:
            store.checkpoints.list("s-one")
        # Not retried: each request went out once (a listing sends its index and objects LISTs side by
        # side, so the second may or may not have left before the first was refused), and nothing above
        # tried again.
        assert 1 <= len(sent) <= 2 and len(set(sent)) == len(sent), sent
        text = str(info.value)
        assert f"LIST refused ({code})" in text and words in text and "retries" not in text
        listed = len(sent)
        with pytest.raises(S3CredentialsError, match=code):
            store.objects.get(key="sessions/_/s-one/lease.json")
        assert len(sent) == listed + 1
    finally:
        store.close()


def test_s3_region_comes_from_the_aws_profile_when_none_is_given(s3_server, monkeypatch, tmp_path):
    from loomray.storage.s3 import S3CredentialsError, S3ObjectStore

    config = tmp_path / "config"
    config.write_text("[profile work]\nregion = eu-west-3\n[default]\nregion = sa-east-1\n")
    credentials = tmp_path / "credentials"
    credentials.write_text("[work]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "work")
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    bucket = s3_server.new_bucket()

    objects = S3ObjectStore(bucket, "root", endpoint_url=s3_server.endpoint_url)
    assert objects.region == "eu-west-3" and objects.client.meta.region_name == "eu-west-3"
    assert list(objects.list(prefix="sessions/")) == []  # the profile's keys sign the request
    objects.close()
    assert S3ObjectStore(bucket, endpoint_url=s3_server.endpoint_url, region="ap-south-1").region == "ap-south-1"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    assert S3ObjectStore(bucket, endpoint_url=s3_server.endpoint_url).region == "us-west-2"
    monkeypatch.setenv("AWS_REGION", "eu-central-1")
    assert S3ObjectStore(bucket, endpoint_url=s3_server.endpoint_url).region == "eu-central-1"

    monkeypatch.setenv("AWS_PROFILE", "nope")
    with pytest.raises(S3CredentialsError, match="AWS profile 'nope'"):
        S3ObjectStore(bucket, endpoint_url=s3_server.endpoint_url)
