"""What travels to loomray's Ray actors, what they are called, and the options they start with.

Only JSON and ids cross into storage; agents travel by value in memory only, and a reference read from
the store is imported only when the operator allowed it (:func:`agent_ref_allowed`).
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import importlib
import random
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from pydantic import BaseModel, ConfigDict, Field
from ray import cloudpickle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from loomray.checkpoint_format import load_checkpoint
from loomray.errors import LoomrayRunError, LoomrayUserError
from loomray.planning import cancelled_result, final_result
from loomray.records import RunResult
from loomray.runtime.connection import NAMESPACE
from loomray.runtime.stored_options import REDACTED, without_secrets
from loomray.session_store import SessionStore
from loomray.storage import Store, open_store
from loomray.storage.ids import user_segment, validate_id

#: Name prefix of the detached supervisors (namespace ``loomray``): one per store, any number per
#: cluster, each named ``loomray:supervisor:{store key}`` (see :func:`supervisor_name`).
SUPERVISOR_PREFIX = "loomray:supervisor:"

#: Session rows in these states are live work a supervisor must own.
ACTIVE_STATES = ("pending", "running")


def store_key(store_url: str) -> str:
    """A short, stable name for a store, carried by every actor name so two stores on one cluster never meet."""
    return hashlib.sha256(store_url.encode()).hexdigest()[:12]


def supervisor_name(store_url: str) -> str:
    """``loomray:supervisor:{store key}``: the name of the supervisor that serves ``store_url``."""
    return f"{SUPERVISOR_PREFIX}{store_key(store_url)}"


def _name_part(value: str) -> str:
    # Ids may hold ':' but never '%' (storage.ids refuses it), so '%3A' for ':' is reversible: the name
    # splits on ':' into exactly four parts, and two different (user, session) pairs never share a name.
    return value.replace(":", "%3A")


def session_actor_name(store_url: str, session_id: str, user_id: str | None = None) -> str:
    """``loomray:{store key}:{user or _}:{session_id}``, injective over (store, user, session): docs/tenancy.md."""
    user = _name_part(user_segment(user_id))
    return f"loomray:{store_key(store_url)}:{user}:{_name_part(validate_id(session_id, 'session_id'))}"


_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def check_ref(ref: object) -> str:
    """Validate the form of an agent reference ``package.module:attribute`` (importing nothing); return it."""
    if not isinstance(ref, str) or not _REF.match(ref):
        raise LoomrayUserError(f"agent reference {ref!r} must look like 'package.module:attribute'")
    return ref


def import_ref(ref: str, what: str) -> Any:
    """Import ``module:attribute`` (dots allowed in the attribute path) and return the object it names;
    :class:`LoomrayUserError` (naming it as ``what``) when the form is wrong or the import fails."""
    module_name, _, attr = check_ref(ref).partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise LoomrayUserError(f"cannot import {what} {ref!r}: {type(e).__name__}: {e}") from e
    return obj


def resolve_ref(ref: str) -> Any:
    """Import ``module:attribute`` and return the Agent it names; :class:`LoomrayUserError` otherwise."""
    obj = import_ref(ref, "agent reference")
    if not all(hasattr(obj, a) for a in ("model", "tools", "tuning", "instructions")):
        raise LoomrayUserError(f"agent reference {ref!r} names a {type(obj).__name__}, not a loomray Agent")
    return obj


def check_pattern(pattern: object) -> str:
    """Validate an allowed-agent pattern: an agent reference, optionally with glob wildcards (``examples.*:agent``)."""
    if not isinstance(pattern, str) or pattern.count(":") != 1 or not all(pattern.partition(":")[::2]) \
            or any(ch.isspace() for ch in pattern):
        raise LoomrayUserError(f"allowed agent pattern {pattern!r} must look like 'package.module:attribute' "
                               "(glob wildcards * ? [] allowed)")
    return pattern


def agent_ref_allowed(ref: Any, patterns: Any) -> bool:
    """Whether ``ref`` is well formed and matches one of ``patterns`` (globs, case-sensitive).

    Asked before importing a reference read from the store: whoever can write to the bucket must not
    choose what it runs.
    """
    try:
        check_ref(ref)
    except Exception:
        return False
    return any(fnmatch.fnmatchcase(ref, p) for p in patterns)


def set_agent_ref(agent: Any, ref: str) -> Any:
    """Register ``ref`` (``"package.module:attribute"``) as the importable name of ``agent``; return ``agent``.

    The reference is stored in the session row, so a session whose actor and supervisor both die can be
    restarted by importing it (on any node); without one it cannot.
    """
    agent.loomray_ref = check_ref(ref)
    return agent


#: Actor options loomray sets itself for every session actor and host: not the caller's to choose.
_RESERVED_OPTIONS = ("name", "namespace", "lifetime", "get_if_exists", "max_restarts", "max_task_retries",
                     "max_concurrency", "concurrency_groups")


class _OptionsProbe:
    """A class never instantiated: Ray validates actor options against it."""


def check_actor_options(options: object) -> dict[str, Any]:
    """Validate ``actor_options`` the way Ray's ``.options()`` will, but now, so a bad option fails where
    the runtime or command is built, not in the supervisor; :class:`LoomrayUserError` otherwise."""
    if not isinstance(options, dict):
        raise LoomrayUserError(f"actor_options must be a dict, got {type(options).__name__}")
    reserved = sorted(set(options) & set(_RESERVED_OPTIONS))
    if reserved:
        raise LoomrayUserError(f"actor_options may not set {', '.join(reserved)}: loomray sets them itself")
    try:
        # Ray's public ``ActorClass.options`` checks every option as the actor's creation would, without
        # starting anything (and without a connection to a cluster).
        ray.remote(_OptionsProbe).options(**options)
    except (TypeError, ValueError) as e:
        shown = without_secrets(options, placeholder=REDACTED)  # the message reaches logs and terminals
        raise LoomrayUserError(f"actor_options {shown!r} are not valid Ray actor options: {e}") from e
    return options


@dataclass(frozen=True)
class RuntimeConfig:
    """What every actor needs to reach the store and to behave; ``storage_options`` (credentials) travel
    to actors in memory, never into the store."""

    store_url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    max_checkpoints_per_session: int = 20
    #: Passed to ``SessionActor.options()``; overrides the defaults below.
    actor_options: dict[str, Any] = field(default_factory=dict)
    #: How many forks of one fan-out run at once (the rest queue).
    max_concurrent_forks: int = 32
    #: Starts charged to a session before it is marked failed (a crash loop); a shared host's crash is
    #: charged to none of its sessions (``SessionWatcher.after_death``).
    max_restarts_per_session: int = 20
    #: Seconds between background ``store.compact()`` runs; None disables.
    compact_interval_s: float | None = 600.0
    #: A finished session actor nobody collected exits after this long.
    linger_s: float = 300.0
    #: The supervisor reports a finished session for this long, then forgets it (bounded memory).
    forget_after_s: float = 600.0
    #: Agent references (``module:attr``, glob wildcards allowed) the supervisor may import for a session
    #: it adopts from the store. References submitted to it are allowed as well; nothing else is.
    allowed_agents: tuple[str, ...] = ()
    #: ``"actor"``: one Ray actor (one worker process) per session. ``"dense"``: sessions are
    #: activations hosted many per host actor (:mod:`loomray.runtime.hosts`).
    placement: str = "actor"
    #: Dense: host actors per node that can run them; None = one per CPU of the node (at least one).
    hosts_per_node: int | None = None
    #: Dense: sessions one host holds before placement opens another host.
    sessions_per_host: int = 1000
    #: Dense: a host without sessions for this long exits, so an autoscaler may release its node.
    host_idle_s: float = 600.0

    def __post_init__(self) -> None:
        if isinstance(self.allowed_agents, str):
            raise TypeError("allowed_agents must be a list of patterns, not one string")
        restarts = self.max_restarts_per_session
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 1:
            raise ValueError(f"max_restarts_per_session must be a positive int, got {restarts!r}")
        check_actor_options(self.actor_options)
        object.__setattr__(self, "allowed_agents", tuple(check_pattern(p) for p in self.allowed_agents))

    def open_store(self) -> Store:
        """Open the store this config names, in the calling process."""
        return open_store(self.store_url, **self.storage_options)


@dataclass(frozen=True)
class AgentSpec:
    """How an agent reaches an actor: an importable reference, or the object by value (in memory, never stored)."""

    ref: str | None = None
    payload: bytes | None = None

    @classmethod
    def of(cls, agent: Any, extra_tools: Any = ()) -> AgentSpec:
        """``agent`` as a spec: a ``"module:attr"`` string by reference; an Agent by value (without its
        runtime), plus its :func:`set_agent_ref` reference."""
        if isinstance(agent, str):
            check_ref(agent)
            if extra_tools:
                raise TypeError("extra_tools need the agent by value; an agent reference cannot carry them")
            return cls(ref=agent)
        clone = copy.copy(agent)
        clone.runtime = None
        return cls(ref=getattr(agent, "loomray_ref", None), payload=cloudpickle.dumps((clone, tuple(extra_tools))))

    def load(self) -> tuple[Any, tuple]:
        """The agent and its extra tools, in this process."""
        if self.payload is not None:
            return cloudpickle.loads(self.payload)
        if self.ref is not None:
            return resolve_ref(self.ref), ()
        raise ValueError("AgentSpec needs a ref or a payload")


class Outcome(BaseModel):
    """How a session actor's run ended, as plain data (plus the exception, in memory only)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    status: Literal["completed", "failed", "fenced"]
    result_json: str | None = None
    error: str | None = None
    error_type: str | None = None
    epoch: int | None = None
    node_id: str | None = None
    #: Passes completed when the run ended (its last event's turn).
    turn: int | None = None
    #: With ``status == "completed"``: the run's ``RunResult.stop_reason`` ("completed", "cancelled",
    #: "paused", "awaiting_approval", "budget_exceeded"), what its status row in the store says.
    stop_reason: str | None = None
    #: The run's exception, to re-raise in the driver; only when it survives pickling. Never stored.
    exception: BaseException | None = Field(default=None, exclude=True)

    @property
    def state(self) -> str:
        """The session's state as every view reports it: a run that returned ended the way its result says."""
        if self.status == "completed" and self.stop_reason:
            return self.stop_reason
        return self.status


def run_result(outcome: Outcome, session_id: str) -> RunResult:
    """The result a run's ``outcome`` carries; its exception (or a ``LoomrayRunError``) when it has none."""
    if outcome.status == "completed" and outcome.result_json is not None:
        return RunResult.model_validate_json(outcome.result_json)
    if outcome.exception is not None:
        raise outcome.exception
    raise LoomrayRunError(f"session {session_id!r} ended {outcome.status}: {outcome.error}")


def ended_result(store: SessionStore, session_id: str, user_id: str | None) -> RunResult | None:
    """The last run's result read back from the store when it completed or was cancelled; else None."""
    row = store.sessions.get(session_id, user_id=user_id)
    if row is None or row.status not in ("completed", "cancelled"):
        return None
    if row.status == "cancelled":
        return cancelled_result(session_id, user_id, row.run_id)
    ckpt = load_checkpoint(store, session_id, user_id=user_id)
    return None if ckpt is None else final_result(ckpt, row.run_id)


def head_node_id() -> str | None:
    """The node id of the cluster's live head, or None (no head among the live nodes)."""
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return str(node["NodeID"])
    return None


def _alive_nodes(exclude: str | None) -> list[str]:
    """Live nodes other than ``exclude``; all live nodes when it is the only one."""
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    others = [n for n in nodes if n != exclude]
    return others or nodes


def session_actor_options(config: RuntimeConfig, session_id: str, user_id: str | None, *,
                          avoid_node: str | None = None) -> dict[str, Any]:
    """The ``.options()`` for a session actor: defaults, then ``config.actor_options``; a restart prefers
    (softly) a live node other than ``avoid_node`` unless the user chose a scheduling strategy."""
    options: dict[str, Any] = {
        "name": session_actor_name(config.store_url, session_id, user_id),
        "namespace": NAMESPACE,
        "lifetime": "detached",
        "num_cpus": 0,
        "max_restarts": 0,
        "max_task_retries": 0,
    }
    options.update(config.actor_options or {})
    if avoid_node is not None and "scheduling_strategy" not in (config.actor_options or {}):
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(random.choice(_alive_nodes(avoid_node)),
                                                                        soft=True)
    return options
