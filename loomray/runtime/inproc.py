"""``InProcRuntime``: the loop in this process, checkpoints and journal in memory."""

from __future__ import annotations

from loomray.runtime.base import Runtime
from loomray.storage import Store, open_store


class InProcRuntime(Runtime):
    """Runs in this process against a fresh in-memory store (``runtime.store``).

    State lives as long as this runtime object; nothing survives the process.
    """

    store: Store

    def __init__(self, max_checkpoints_per_session: int = 20) -> None:
        super().__init__(open_store("memory://"), max_checkpoints_per_session=max_checkpoints_per_session)

    def __repr__(self) -> str:
        return f"InProcRuntime(max_checkpoints_per_session={self.max_checkpoints_per_session})"
