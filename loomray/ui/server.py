"""Serving the session browser: the app over a store, on uvicorn, bound to loopback unless told otherwise."""

from __future__ import annotations

import os
import sys
from typing import Any

import uvicorn
from starlette.applications import Starlette

from loomray.runtime.connection import normalize_store_url
from loomray.storage import open_store
from loomray.storage.ids import validate_id
from loomray.ui.app import create_app
from loomray.ui.security import TOKEN_ENV, Guard, check_binding, is_loopback
from loomray.ui.state import UiState

DEFAULT_HOST = "127.0.0.1"
#: Ray's dashboard listens on 8265; the session browser takes the port after it.
DEFAULT_PORT = 8266


def build_app(store_url: str, *, address: str | None = None, host: str = DEFAULT_HOST, token: str | None = None,
              user_id: str | None = None, **settings: Any) -> Starlette:
    """The app for ``store_url``; refuses a non-loopback ``host`` without a token (``LOOMRAY_UI_TOKEN`` is the
    default token). ``settings`` go to :class:`UiState` (``stream_s``, ``poll_s``)."""
    token = token or os.environ.get(TOKEN_ENV) or None
    check_binding(host, token)
    if user_id is not None:
        validate_id(user_id, "user_id")
    url = normalize_store_url(store_url)
    state = UiState(store=open_store(url), store_url=url, guard=Guard(token=token, loopback=is_loopback(host)),
                    address=address, only_user=user_id, **settings)
    return create_app(state)


def serve(store_url: str, *, address: str | None = None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
          token: str | None = None, user_id: str | None = None) -> None:
    """Serve the session browser until interrupted."""
    app = build_app(store_url, address=address, host=host, token=token, user_id=user_id)
    print(f"loomray ui: http://{host}:{port}/ over {store_url}" + (f" (user {user_id})" if user_id else ""),
          file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
