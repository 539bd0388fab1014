"""What a submitted exploration refuses before anything reaches the cluster, and the judge it runs off the loop.

No cluster: the checks run in the driver (``submit_exploration``) or on the request (``check_request``)
before a supervisor is asked; the on-cluster path is tests/ray/test_ray_explore.py.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

pytest.importorskip("ray")

from explore_agents import async_judge, judge, variant  # noqa: E402

from loomray import JudgeInput, ModelJudge, Tuning, Variant  # noqa: E402
from loomray.errors import LoomrayUserError  # noqa: E402
from loomray.explore.record import callable_ref  # noqa: E402
from loomray.models import ScriptedModel  # noqa: E402
from loomray.runtime.explorations import REQUEST_FIELDS, check_request, off_loop, submit_exploration  # noqa: E402


@pytest.mark.parametrize("bad", [Variant(prompt="p", tuning=Tuning(checkpoint=lambda r: True)),
                                 Variant(prompt="p", model=ScriptedModel(["x"])), "a prompt"])
def test_variants_that_do_not_store_whole_are_refused_before_the_cluster_is_asked(tmp_path, bad):
    from loomray.runtime import RayRuntime

    runtime = RayRuntime(tmp_path / "store")  # never connects: the refusal comes first
    with pytest.raises(LoomrayUserError, match="stores its variants"):
        asyncio.run(submit_exploration(runtime, "mod:agent", "mod:judge", "base", variants=[variant("a", 0.1), bad]))
    assert runtime._supervisor is None
    runtime.close()


def test_a_request_has_exactly_its_fields_and_well_formed_references():
    good = dict.fromkeys(REQUEST_FIELDS) | {"agent_ref": "mod:agent", "judge_ref": "mod:judge"}
    assert check_request(good) == good
    with pytest.raises(LoomrayUserError, match="fields"):
        check_request({**good, "extra": 1})
    with pytest.raises(LoomrayUserError, match="agent reference"):
        check_request({**good, "judge_ref": "os.system('x')"})


def test_a_sync_judge_runs_off_the_loop_and_is_still_the_judge_the_plan_names():
    wrapped = off_loop(judge)
    assert wrapped is not judge and callable_ref(wrapped) == callable_ref(judge)
    scored = asyncio.run(wrapped(JudgeInput("b", variant("b", 0.4), 1, [], None, 0)))
    assert scored.value == 0.4
    model_judge = ModelJudge("m", "rubric")
    assert off_loop(async_judge) is async_judge and off_loop(model_judge) is model_judge


def test_marks_and_requests_a_bucket_writer_made_up_are_skipped_with_a_warning(tmp_path, caplog):
    """A supervisor's pass over the submitted explorations never fails on what it reads (it would fail every
    pass, sessions' adoption included) and never imports a reference nobody allowed."""
    from loomray.explore.record import ExplorationRecord
    from loomray.runtime.actors import RuntimeConfig
    from loomray.runtime.adoption import AdoptionPolicy
    from loomray.runtime.explorations import Explorations
    from loomray.storage import layout

    config = RuntimeConfig(store_url=str(tmp_path / "store"), allowed_agents=("mod:*",))
    store = config.open_store()

    def mark(xid: str, body: bytes) -> None:
        store.objects.put(key=layout.submitted_exploration_key(None, xid), data=body)

    mark("xpl-deep", b"[" * 100_000)  # JSON nested past the parser's recursion limit
    mark("xpl-nothing", b'{"session_id": "s"}')  # no request in its record
    request = dict.fromkeys(REQUEST_FIELDS) | {"exploration_id": "xpl-evil", "agent_ref": "evil:agent",
                                               "judge_ref": "mod:judge", "actor_options": {}, "secret_env_vars": []}
    ExplorationRecord(store.objects, "s", None, "xpl-evil").put("submit", request)
    mark("xpl-evil", b'{"session_id": "s"}')
    explorations = Explorations(None, config, store, AdoptionPolicy(config, store))
    with caplog.at_level("WARNING", logger="loomray.runtime.explorations"):
        assert asyncio.run(explorations.resume(None)) == []
    skipped = "\n".join(r.getMessage() for r in caplog.records)
    assert all(x in skipped for x in ("xpl-deep", "xpl-nothing", "'evil:agent'"))
    assert "evil" not in sys.modules
