"""``RunRequest``: one run or resume of a session, as the runtimes pass it on."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loomray.journal import input_hash
from loomray.storage.ids import validate_id
from loomray.telemetry.context import current_traceparent


class RunRequest(BaseModel):
    """One run or resume, as plain JSON (it crosses process and actor boundaries).

    ``fork_of`` names the source session when this request starts a fork:
    ``from_checkpoint`` is then a checkpoint of that session and
    ``session_id`` the fork's new id. ``trace_parent`` is the W3C
    ``traceparent`` of the span current where the request was made (None
    without one): the run's spans continue that trace in whichever process,
    and however many incarnations, execute it. ``variant`` is the stored
    form of the :class:`~loomray.variants.Variant` a fork runs (None: the
    agent as it is); the run record keeps it, so whoever continues the fork
    runs the same agent.
    """

    model_config = ConfigDict(frozen=True)

    kind: Literal["run", "resume"] = "run"
    prompt: str | None = None
    session_id: str
    user_id: str | None = None
    from_checkpoint: str = "latest"
    run_id: str | None = None
    metadata: dict[str, Any] | None = None
    context: Any = None
    output_schema: dict[str, Any] | None = None
    effort: str | None = None
    fork_of: str | None = None
    variant: dict[str, Any] | None = None
    trace_parent: str | None = Field(default_factory=current_traceparent)
    #: Chosen by the driver for each hand-off to a supervisor (``RayRuntime``); a resend of the same hand-off
    #: to a replacement supervisor carries it, which finds the run it already started by it. Not part of
    #: the spec: it never decides which run a request continues.
    request_id: str | None = None

    def spec_hash(self) -> str:
        """What makes two requests "the same run" for the recovery rule."""
        fields = {"kind", "prompt", "session_id", "user_id", "from_checkpoint", "fork_of", "output_schema", "effort"}
        if self.variant is not None:  # only then: the hash of a request without one stays what it always was
            fields.add("variant")
        return input_hash(self.model_dump(mode="json", include=fields))

    def continues_last_run(self) -> bool:
        """``resume(None)`` in place: it continues an unfinished last run exactly as a re-issued ``run()`` does."""
        return (self.kind == "resume" and self.prompt is None and self.from_checkpoint == "latest"
                and self.fork_of is None and self.run_id is None)

    def exploration_id(self) -> str | None:
        """``metadata["exploration_id"]`` when it is an id (what status rows carry, so a listing filters branches
        of one exploration by it); None otherwise."""
        value = (self.metadata or {}).get("exploration_id")
        return value if isinstance(value, str) and _is_id(value) else None

    def stored_json(self) -> dict[str, Any]:
        """The request as its run record stores it.

        In-process callers may pass live objects as context; the stored request names them instead.
        """
        return json.loads(self.model_dump_json(fallback=lambda v: f"<unserializable {type(v).__name__}>"))


def _is_id(value: str) -> bool:
    try:
        validate_id(value)
    except ValueError:
        return False
    return True
