"""The typed answers to a tool call that waits for a person: :class:`Approve` and :class:`Respond`.

Pass them in ``agent.resume(None, session_id=..., approvals={call_id: ...})``
beside the plain forms (``True`` approves, ``False`` or a reason denies).
Each is stored as a control request and journaled before it acts, exactly
like an approval or a denial (:mod:`loomray.control`): a crash of any
process on the way applies it once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Approve:
    """Run the tool call; with ``arguments``, with those in place of the ones the model wrote.

    The transcript keeps the model's call as it wrote it; the tool result,
    and the journal, show what ran. ``arguments`` must be a JSON object.
    """

    arguments: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.arguments is None:
            return
        if not isinstance(self.arguments, dict):
            raise TypeError(f"Approve(arguments=...) takes a JSON object (dict), got {type(self.arguments).__name__}")
        try:
            json.dumps(self.arguments)
        except (TypeError, ValueError) as e:
            raise TypeError(f"Approve(arguments=...) must be JSON: {e}") from e


@dataclass(frozen=True)
class Respond:
    """Answer in the tool call's place: the tool never runs, the model gets ``text`` as the call's result."""

    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Respond(text) takes a str, got {type(self.text).__name__}")
