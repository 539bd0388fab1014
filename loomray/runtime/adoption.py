"""Adoption: which active sessions of the store a supervisor takes over, and which it refuses.

The store is not trusted to choose code or targets: a session is restarted only when its agent reference
is allowed here and its stored request is for the very session and user it is stored under; a refused one
is marked failed with the reason. When a supervisor adopts: docs/design.md, "Supervisor (Ray)".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Iterable
from typing import Any

from loomray.errors import LoomrayUserError
from loomray.records import utcnow
from loomray.run_errors import INDEX_ERROR_MAX
from loomray.runtime import active
from loomray.runtime.actors import AgentSpec, RuntimeConfig, agent_ref_allowed, check_actor_options, check_pattern
from loomray.runtime.stored_options import restore_secrets, trusted_options
from loomray.runtime.watcher import WatchedSession, quarantine
from loomray.session import RunRequest
from loomray.storage import SessionRow, Store

log = logging.getLogger("loomray.runtime.adoption")

#: How long a lease newer than its session's status row may stay silent before the session is adopted anyway.
OWNER_SILENT_S = 20.0


def same_request(a: str, b: str) -> bool:
    """Two run requests as JSON are the same request (whatever their key order or spacing)."""
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return a == b


class AdoptionPolicy:
    """Decides, row by row, whether the supervisor takes over an active session of the store."""

    def __init__(self, config: RuntimeConfig, store: Store) -> None:
        self._config = config
        self._store = store
        #: Agent reference patterns adopted sessions may use: the config's, the operator's, and every
        #: reference submitted here.
        self._allowed: set[str] = set(config.allowed_agents)
        #: When each newer-than-its-row lease was first seen, by (user, session, row epoch, lease epoch).
        self._newer_lease_seen: dict[tuple[str | None, str, int, int], float] = {}

    def allow(self, patterns: Iterable[str]) -> None:
        """Allow more agent references (patterns as in ``RuntimeConfig.allowed_agents``) for adopted sessions."""
        self._allowed.update(check_pattern(p) for p in patterns)

    @property
    def allowed(self) -> frozenset[str]:
        """The allowed agent reference patterns now."""
        return frozenset(self._allowed)

    def allows(self, ref: str) -> bool:
        """Whether an adopted session may import agent reference ``ref``."""
        return agent_ref_allowed(ref, self._allowed)

    async def review(self, row: SessionRow, mark: dict[str, Any], current: WatchedSession | None,
                     known_nodes: set[str] | None) -> WatchedSession | None:
        """The session to watch for ``row``, or None when it is not this supervisor's to restart.

        ``current`` is what the supervisor holds for the session; ``mark`` its
        active mark (placement and actor options it ran with; ``{}`` when
        unknown); ``known_nodes`` the nodes of this cluster (None: take
        sessions of any cluster, see ``Supervisor``).
        """
        # node_id is set only by a Ray session actor: rows of in-process runtimes are not ours.
        if (current is not None and not current.done.done()) or not row.node_id:
            return None
        if known_nodes is not None and row.node_id not in known_nodes:
            return None  # another cluster's session: restarting it here would fence it
        # The request lives in the run's record, beside the session's objects (never in the index).
        request_json = await asyncio.to_thread(self.request_of, row)
        if request_json is None:
            return None
        if current is not None and same_request(current.request_json, request_json):
            return None  # we finished this very run; the row is only behind
        # A newer lease than the row's means a live owner elsewhere took over: not ours to restart, unless
        # that owner stays silent (it died between its lease and its first status row).
        epoch = await asyncio.to_thread(self._store.leases.current_epoch, row.session_id, user_id=row.user_id)
        if row.epoch < epoch and not self._owner_silent(row, epoch):
            return None
        refusal = self.refusal(row, request_json)
        if refusal is not None:
            await self.refuse(row, refusal)
            return None
        agent = AgentSpec(ref=row.agent_ref) if row.agent_ref else None
        w = WatchedSession(row.session_id, row.user_id, request_json, agent, last_node=row.node_id, epoch=row.epoch)
        w.config = self.config_for(mark)
        # The crash attribution of the supervisor that ran it (a mark is only a hint: ints and a flag, or none).
        crashes = mark.get("host_crashes")
        w.host_crashes = crashes if isinstance(crashes, int) and not isinstance(crashes, bool) and crashes > 0 else 0
        charged = mark.get("charged")
        w.charged_before = charged if isinstance(charged, int) and not isinstance(charged, bool) and charged > 0 else 0
        if mark.get("quarantined") is True:
            quarantine(w, w.config or self._config)
        return w

    def _owner_silent(self, row: SessionRow, epoch: int) -> bool:
        """True once lease ``epoch`` has gone ``OWNER_SILENT_S`` without a status row of its own.

        A live owner writes its ``running`` row right after it takes the lease; one that never does died
        first (a host crash, a node loss, with no supervisor to see it). Taking over is safe either way:
        the new epoch fences a late owner.
        """
        key = (row.user_id, row.session_id, row.epoch, epoch)
        first = self._newer_lease_seen.setdefault(key, time.monotonic())
        if time.monotonic() - first < OWNER_SILENT_S:
            return False
        del self._newer_lease_seen[key]
        log.warning("session %r: lease epoch %d has written no status row for %.0f s; adopting it",
                    row.session_id, epoch, OWNER_SILENT_S)
        return True

    def config_for(self, mark: dict[str, Any]) -> RuntimeConfig | None:
        """The config an adopted session restarts with: the placement and actor options it ran with, as its
        active mark recorded them (None: the supervisor's own). Options the mark holds but Ray would refuse
        (a bucket is not trusted) are dropped with a warning, and the supervisor's apply."""
        changes: dict[str, Any] = {}
        placement = mark.get("placement")
        if placement in ("actor", "dense") and placement != self._config.placement:
            changes["placement"] = placement
        options = mark.get("actor_options")
        if isinstance(options, dict):
            options = self._with_secrets(options, mark.get("secret_env_vars"))
            options, dropped = trusted_options(options, self._config.actor_options)
            if dropped:  # a bucket writer must not choose what code the cluster runs
                log.warning("ignoring stored actor options of an adopted session that choose code, not placement: "
                            "%s (this supervisor's own apply)", ", ".join(dropped))
        if options is not None and options != self._config.actor_options:
            try:
                changes["actor_options"] = check_actor_options(options)
            except LoomrayUserError as e:
                log.warning("ignoring the stored actor options of an adopted session: %s", e)
        return dataclasses.replace(self._config, **changes) if changes else None

    def _with_secrets(self, options: dict[str, Any], names: Any) -> dict[str, Any]:
        """Stored options with the secret env vars the mark left out taken from this supervisor's own options."""
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return options
        options, missing = restore_secrets(options, names, self._config.actor_options)
        if missing:
            log.warning("an adopted session ran with env vars %s, which are never stored; its restarted actor "
                        "sees them only if its node's environment has them (or pass them to this supervisor's "
                        "actor options, e.g. `loomray supervise --runtime-env`)", ", ".join(missing))
        return options

    def request_of(self, row: SessionRow) -> str | None:
        """The JSON run request of the run ``row`` reports, or None (not known yet: try next pass).

        It is the request in the session's last run record when that record is
        the row's run; a session written before run records keeps it in the row.
        """
        record = self._store.runs.last(row.session_id, user_id=row.user_id)
        if record is not None:
            if record.run_id != row.run_id or not record.request:
                return None  # a newer run started and its row is not written yet, or nothing to re-run
            return json.dumps(record.request)
        return row.spec_json or None

    def refusal(self, row: SessionRow, request_json: str) -> str | None:
        """Why a session read from the store must not be restarted here, or None (see the module docstring)."""
        try:
            request = RunRequest.model_validate_json(request_json)
        except ValueError as e:
            return f"its stored run request is unreadable: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        if (request.session_id, request.user_id) != (row.session_id, row.user_id):
            return (f"its stored run request is for session {request.session_id!r} (user {request.user_id!r}), "
                    f"not for the session it is stored under")
        if row.agent_ref and not self.allows(row.agent_ref):
            return (f"agent reference {row.agent_ref!r} is not allowed on this supervisor "
                    "(allow it with `loomray supervise --allow-agent` or RayRuntime(allowed_agents=...))")
        return None

    async def refuse(self, row: SessionRow, reason: str) -> None:
        """Log the refusal and mark the session failed with it (it is not adopted, and not retried)."""
        log.warning("supervisor refuses to restart session %r (user %r): %s", row.session_id, row.user_id, reason)
        failed = SessionRow(session_id=row.session_id, user_id=row.user_id, status="failed", updated_at=utcnow(),
                            run_id=row.run_id, agent_ref=row.agent_ref, epoch=row.epoch, node_id=row.node_id,
                            error=f"refused by the supervisor: {reason}"[:INDEX_ERROR_MAX])
        try:
            await asyncio.to_thread(self._store.sessions.put, failed)
        except Exception as e:
            log.warning("could not mark session %r failed: %s", row.session_id, e)
        await active.clear(self._store, row.session_id, row.user_id)
