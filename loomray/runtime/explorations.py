"""Submitted explorations: a detached Ray actor drives an exploration, so it outlives the driver that asked.

``submit_exploration(...)`` starts one actor per exploration, named
``loomray-explore:{exploration_id}`` in the ``loomray`` namespace, with
``max_restarts=-1``. Its constructor starts the exploration in a thread of
its own; when Ray restarts the actor (its node was lost) the constructor
runs again and continues the exploration by its id from the store (nothing
finished runs again, no stored score is paid twice). The actor exits when the
exploration is over; a failure is stored in the exploration's record
(``driver-error.json``) first.

What crosses into the actor is strings only: the store URL, the agent's and
the judge's ``module:attr`` references (importable on the cluster's nodes),
and the arguments as JSON.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from typing import Any

import ray

from loomray.errors import LoomrayUserError
from loomray.explore import Budget, ModelJudge
from loomray.explore.record import ExplorationRecord, variant_from_doc
from loomray.runtime.actors import check_ref, import_ref, resolve_ref, set_agent_ref
from loomray.runtime.connection import NAMESPACE
from loomray.runtime.ray_runtime import RayRuntime
from storage import open_store

log = logging.getLogger("loomray.runtime.explorations")

#: Name prefix of the actors that drive submitted explorations.
EXPLORE_PREFIX = "loomray-explore:"


def import_judge(ref: str) -> Any:
    """The judge at ``module:attr``: a callable or a ``ModelJudge``; ``LoomrayUserError`` otherwise."""
    obj = import_ref(ref, "judge")
    if not isinstance(obj, ModelJudge) and not callable(obj):
        raise LoomrayUserError(f"judge {ref!r} names a {type(obj).__name__}, not a callable or a ModelJudge")
    return obj


async def run_submitted(spec: dict[str, Any]) -> None:
    """Run (or continue) the exploration ``spec`` describes, on a RayRuntime of this cluster."""
    runtime = RayRuntime(spec["store_url"], placement=spec["placement"], actor_options=spec["actor_options"])
    try:
        agent = set_agent_ref(copy.copy(resolve_ref(spec["agent_ref"])), spec["agent_ref"])
        agent.runtime = runtime
        args = spec["args"]
        await agent.explore(spec["session_id"], variants=[variant_from_doc(v) for v in args["variants"]],
                            judge=import_judge(spec["judge_ref"]), from_checkpoint=args["from_checkpoint"],
                            rounds=args["rounds"], keep=args["keep"], score_every=args["score_every"],
                            adopt=args["adopt"], budget=Budget(**args["budget"]),
                            exploration_id=spec["exploration_id"], user_id=spec["user_id"])
    finally:
        runtime.close()


@ray.remote(num_cpus=0, max_restarts=-1)
class ExplorationDriver:
    """Drives one submitted exploration (see the module docstring)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        threading.Thread(target=self._drive, name="exploration", daemon=True).start()

    def _drive(self) -> None:
        try:
            asyncio.run(run_submitted(self.spec))
        except Exception as e:  # noqa: BLE001 - stored for whoever looks, then the actor goes
            log.exception("exploration %s failed", self.spec["exploration_id"])
            try:
                ExplorationRecord(open_store(self.spec["store_url"]).objects, self.spec["session_id"], self.spec["user_id"],
                                  self.spec["exploration_id"]).put("driver-error", {"error": f"{type(e).__name__}: {e}"})
            except Exception:  # noqa: BLE001
                log.exception("could not store the failure of exploration %s", self.spec["exploration_id"])
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def ping(self) -> str:
        """The exploration this actor drives (a liveness probe)."""
        return str(self.spec["exploration_id"])


def submit_exploration(spec: dict[str, Any], actor_options: dict[str, Any] | None = None) -> str:
    """Start the detached actor that drives ``spec``'s exploration; return its exploration id.

    ``spec``: ``store_url``, ``placement``, ``actor_options`` (the branches'), ``agent_ref``, ``judge_ref``,
    ``session_id``, ``user_id``, ``exploration_id`` and ``args`` (variants as JSON documents, rounds, keep,
    score_every, adopt, budget as a dict, from_checkpoint). ``actor_options`` place the driver actor.
    """
    check_ref(spec["agent_ref"])
    check_ref(spec["judge_ref"])
    options = {**(actor_options or {}), "name": EXPLORE_PREFIX + spec["exploration_id"], "namespace": NAMESPACE,
               "lifetime": "detached"}
    ExplorationDriver.options(**options).remote(spec)  # type: ignore[attr-defined]
    return str(spec["exploration_id"])
