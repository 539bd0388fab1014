"""What a submitted exploration refuses before anything reaches the cluster, and the judge it runs off the loop.

No cluster: the checks run in the driver (``submit_exploration``) or on the request (``check_request``)
before a supervisor is asked; the on-cluster path is tests/ray/test_ray_explore.py.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from explore_agents import async_judge, judge, step, variant  # noqa: E402

from loomray import JudgeInput, ModelJudge, Tuning, Variant  # noqa: E402
from loomray.errors import LoomrayUserError  # noqa: E402
from loomray.explore.record import callable_ref  # noqa: E402
from loomray.models import ScriptedModel  # noqa: E402
from loomray.runtime.explorations import REQUEST_FIELDS, check_request, off_loop, submit_exploration  # noqa: E402


@pytest.mark.parametrize("bad", [Variant(prompt="p", tools=[step]), Variant(prompt="p", tuning=Tuning()),
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
