"""``loomray ui``: the session browser over a store (needs the ``loomray[ui]`` extra).

The browser is an application of its own (:mod:`loomray.ui`); it is imported
only when this command runs, so the other commands need neither Starlette
nor uvicorn, and a missing extra is one clear line.
"""

from __future__ import annotations

import click

from loomray.cli.common import CliError, address_option, guarded, store_option, store_url_or_fail


@click.command("ui")
@store_option
@address_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; any but loopback needs a token.")
@click.option("--port", default=8266, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--token", default=None, envvar="LOOMRAY_UI_TOKEN",
              help="Token every request must carry (env LOOMRAY_UI_TOKEN); open the UI as /?token=T once.")
@click.option("--user", "user_id", default=None, help="Show and act on this user's sessions only.")
@guarded
def ui(store_url: str | None, address: str | None, host: str, port: int, token: str | None,
       user_id: str | None) -> None:
    """Serve the session browser: sessions, transcripts, fork trees, approvals, live updates."""
    url = store_url_or_fail(store_url)
    try:
        # Lazy: the extra is optional, and loomray.ui imports no command module that imports this one (no cycle).
        from loomray.ui import server
    except ImportError as e:
        raise CliError(f"the session browser needs its extra: pip install 'loomray[ui]' ({e})") from e
    server.serve(url, address=address, host=host, port=port, token=token, user_id=user_id)
