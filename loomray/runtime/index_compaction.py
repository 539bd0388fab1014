"""Background compaction of the store's index (merging its small Parquet files), scheduled by the supervisor,
the one long-lived process of a cluster. Keeping a transcript short is *condensing*, not this."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from loomray.storage import Store

log = logging.getLogger("loomray.runtime.index_compaction")


class IndexCompaction:
    """Compacts one store's index now (:meth:`compact`) or every so often (:meth:`every`)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        #: Compactions that succeeded.
        self.count = 0

    async def every(self, interval_s: float) -> None:
        """Compact every ``interval_s`` seconds, for ever (the supervisor's background task)."""
        while True:
            await asyncio.sleep(interval_s)
            await self.compact()

    async def compact(self) -> dict[str, Any] | None:
        """Compact the index now; its report as a dict, or None on failure (logged, never raised)."""
        try:
            report = await asyncio.to_thread(self._store.compact)
        except Exception as e:  # compaction is an optimisation; never fatal
            log.warning("index compaction failed: %s: %s", type(e).__name__, e)
            return None
        self.count += 1
        log.info("index compacted: %s", report)
        return dict(report.__dict__) if hasattr(report, "__dict__") else {"report": str(report)}
