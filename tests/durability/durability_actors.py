"""The actors of a scenario besides the writers: compactors, a pruner, a lease vandal and cold readers.

Each factory takes the :class:`~durability_world.World` and returns the
function its thread runs; what the actor did goes to the world's ledger.
"""

from __future__ import annotations

import random
import traceback
from datetime import datetime, timedelta, timezone

from durability_explore import explorer
from durability_moves import controller, corrupter, deleter, fork_resumer, forker, planter
from durability_world import ReaderObs, World, close_readers

from loomray.checkpoint_format import load_checkpoint
from loomray.errors import LoomrayError
from loomray.storage.errors import StorageError, TransientStorageError
from loomray.storage.faults import ActorCrashed


def compactor(world: World, name: str, rounds: int = 3, grace: float | None = None):
    """``store.compact()`` ``rounds`` times; ``grace`` (seconds) drops tombstones younger than the default hour."""

    def fn() -> None:
        rng = random.Random(f"{world.spec.seed}/{name}")
        store = world.new_store()
        for _ in range(rounds):
            world.sched.pause(rng.randint(0, 30))
            start = world.faulty.call_count
            try:
                report = store.compact(tombstone_grace=None if grace is None else timedelta(seconds=grace))
                outcome = f"ok {report}"
            except (StorageError, LoomrayError) as e:
                outcome = f"{type(e).__name__}: {e}"
            except Exception as e:
                outcome = f"{type(e).__name__}: {e}"
                world.unexpected.append((name, traceback.format_exc()))
            world.compactions.append((name, start, world.faulty.call_count, outcome))
        close_readers(store)
    return fn

def pruner(world: World, name: str, after_acks: int = 1, future: bool = False, whole: bool = False,
           target: str = "session"):
    """``prune(before=...)`` of the session: the wall time of its ``after_acks``-th acknowledgement, or a day
    ahead (``future``: everything prune may remove). ``whole``: ``prune`` without ``before`` (everything, and
    the run's records), noted as a cutoff ten years ahead. ``target="fork"``: prunes the first finished fork of
    the session instead, whole; noted with a cutoff that excuses no row of the session by its age."""

    def fn() -> None:
        acks = sorted((a for inc in world.incarnations for a in inc.acks), key=lambda a: a[0])
        before = acks[min(after_acks, len(acks)) - 1][3] if acks else datetime.now(timezone.utc)
        if future:
            before = datetime.now(timezone.utc) + timedelta(days=1)
        sid = world.spec.session_id
        if whole:
            before = datetime.now(timezone.utc) + timedelta(days=3650)
        if target == "fork":
            forks = [f["request"].session_id for f in world.forks if f["outcome"] == "ok"]
            if not forks:
                return
            sid, before = forks[0], datetime.min.replace(tzinfo=timezone.utc)
        store = world.new_store()
        start = world.faulty.call_count
        try:
            report = store.prune(before=None if whole or target == "fork" else before, session_id=sid,
                                 user_id=world.spec.user_id)
            outcome = f"ok {report}"
        except (StorageError, LoomrayError) as e:
            outcome = f"{type(e).__name__}: {e}"
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
            world.unexpected.append((name, traceback.format_exc()))
        world.prunes.append((name, start, world.faulty.call_count, before, outcome))
        close_readers(store)
    return fn

def vandal(world: World, name: str):
    """A bucket lifecycle rule or an operator's cleanup: deletes the session's lease.json."""

    def fn() -> None:
        from loomray.storage import layout

        key = layout.lease_key(world.spec.session_id, world.spec.user_id)
        try:
            world.faulty.delete(keys=[key])
            world.vandalism.append((name, world.faulty.call_count))
        except TransientStorageError:
            pass
    return fn

def reader(world: World, name: str, rounds: int = 2, any_order: bool = False):
    """Cold reads of the session ``rounds`` times; ``any_order``: each read's parallel calls in a drawn order."""
    sid, uid = world.spec.session_id, world.spec.user_id

    def fn() -> None:
        rng = random.Random(f"{world.spec.seed}/{name}")
        order = random.Random(f"{world.spec.seed}/{name}/order") if any_order else None
        for _ in range(rounds):
            world.sched.pause(rng.randint(0, 30))
            obs = ReaderObs(name, start=world.faulty.call_count)
            store = world.new_store(any_order=order)
            try:
                rows = store.checkpoints.list(sid, user_id=uid, limit=None)
                obs.listed = [r.checkpoint_id for r in rows]
                obs.head_id = rows[0].checkpoint_id if rows else None
                ckpt = load_checkpoint(store, sid, "latest", user_id=uid)  # read back whole: the chain too
                if ckpt is not None:
                    obs.latest_id, obs.latest_epoch = ckpt.checkpoint_id, ckpt.epoch
                if rows:
                    obs.explicit_ok = store.checkpoints.get(sid, rows[0].checkpoint_id, user_id=uid) is not None
                # Planning a resume also reads the journal of the last run.
                runs = store.journal.runs(sid, user_id=uid)
                if runs:
                    store.journal.list(sid, runs[-1], user_id=uid)
            except TransientStorageError as e:
                obs.transient, obs.error = True, str(e)
            except ActorCrashed:
                raise
            except Exception as e:
                # Loading a checkpoint wraps a storage error (a transient one included) as its cause.
                obs.transient = isinstance(e.__cause__, TransientStorageError)
                obs.error = f"{type(e).__name__}: {e}"
            obs.end = world.faulty.call_count
            world.readers.append(obs)
            close_readers(store)
    return fn



def writer(world: World, name: str, **opts):
    return world.writer(name, **opts)


#: Every role a scenario's actor can play: ``factory(world, name, **options)`` -> the actor's function.
ROLES = {"writer": writer, "compactor": compactor, "pruner": pruner, "vandal": vandal, "reader": reader,
         "forker": forker, "fork_resumer": fork_resumer, "deleter": deleter, "planter": planter,
         "corrupter": corrupter, "controller": controller, "explorer": explorer}
