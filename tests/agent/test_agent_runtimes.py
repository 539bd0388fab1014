"""Runtime construction: stores chosen explicitly from a path/URL, state per instance, lazy Ray import."""

from __future__ import annotations

import pytest

from loomray import Agent, Tuning
from loomray.models import ScriptedModel
from loomray.runtime import InProcRuntime, LocalRuntime, Runtime


def _run(runtime, sid="s"):
    agent = Agent("", model=ScriptedModel(["ok"]), runtime=runtime, tuning=Tuning(checkpoint=True))
    agent.run_sync("go", session_id=sid)
    return agent


def test_inproc_runtimes_do_not_share_state():
    a, b = InProcRuntime(), InProcRuntime()
    _run(a)
    assert len(a.store.checkpoints.list("s")) == 1 and b.store.checkpoints.list("s") == []
    assert a.store.url.startswith("memory://")


def test_local_runtime_accepts_path_file_url_or_store(tmp_path):
    by_path = LocalRuntime(tmp_path / "d")
    _run(by_path)
    by_url = LocalRuntime(f"file://{tmp_path / 'd'}")
    assert len(by_url.store.checkpoints.list("s")) == 1  # same directory, same state
    assert LocalRuntime(by_path.store).store is by_path.store
    with pytest.raises(TypeError):
        LocalRuntime(by_path.store, endpoint_url="http://127.0.0.1:1")
    with pytest.raises(ValueError):
        LocalRuntime("gopher://nowhere")
    with pytest.raises(TypeError):
        LocalRuntime(tmp_path, max_checkpoints_per_session="20")


def test_runtime_without_a_store_lists_nothing():
    class NoStore(Runtime):
        def __init__(self):
            super().__init__(None)

    agent = Agent("", model=ScriptedModel(["ok"]), runtime=NoStore())
    assert agent.list_checkpoints_sync("s") == [] and agent.get_checkpoint_sync("s") is None


def test_ray_runtime_is_exported_lazily():
    import loomray.runtime as rt

    assert "RayRuntime" in rt.__all__
    with pytest.raises(AttributeError):
        rt.NoSuchRuntime  # noqa: B018
