"""Background compaction of the store's index, scheduled by the supervisor.

"Compaction" in loomray always means this: merging the index's small Parquet
files (:meth:`storage.Store.compact`, ``loomray compact``). Keeping a long
transcript short is *condensing* (:mod:`loomray.condense`).

Every session run adds small index files; readers of the index (``loomray
query``, ``status`` without a cluster) slow down as they pile up. The
supervisor is the one long-lived process of a cluster, so it compacts every
``RuntimeConfig.compact_interval_s``. Compaction is an optimisation: a
failure is logged and the next round tries again.
"""

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
