"""``LocalRuntime``: the loop in this process, state in a directory or a bucket."""

from __future__ import annotations

import os
from typing import Any

from loomray.runtime.base import Runtime
from loomray.session_store import SessionStore
from loomray.storage import open_store


class LocalRuntime(Runtime):
    """Runs in this process; checkpoints and journal live in ``store``.

    ``store`` is a directory path, a ``file://`` URL, an ``s3://bucket/prefix``
    URL (``storage_options`` such as ``endpoint_url``, ``key``, ``secret``,
    ``region`` go to the S3 backend), or an already opened store.
    """

    def __init__(self, store: str | os.PathLike[str] | SessionStore, max_checkpoints_per_session: int = 20,
                 **storage_options: Any) -> None:
        if isinstance(store, (str, os.PathLike)):
            store = open_store(os.fspath(store), **storage_options)
        elif storage_options:
            raise TypeError("storage options only apply when store is a path or URL")
        super().__init__(store, max_checkpoints_per_session=max_checkpoints_per_session)

    def __repr__(self) -> str:
        return f"LocalRuntime({getattr(self.store, 'url', self.store)!r})"
