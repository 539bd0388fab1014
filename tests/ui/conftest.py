"""The session browser's test bed: a local store with sessions of two users, servers on loopback, and Chromium.

The store and its servers are made once for the whole UI suite (the browser
and safety tests act on different sessions of it). The servers
run the real app on uvicorn in threads of this process (a free port each); sessions run through the same in-process runtime as ``loomray
resume`` without a cluster, with their agent's reference stored, so the
page's Resume button can continue them. The browser is the OS's headless
Chromium driven by Playwright (no browser download).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import ui_agents
import uvicorn
from playwright import sync_api as playwright_api
from ui_harness import bound, wait_for

from loomray.ui.server import build_app

CHROMIUM = os.environ.get("LOOMRAY_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


@dataclass
class Seeded:
    """The store's sessions the tests look at."""

    url: str
    fork_root: str
    forks: list[str]
    xss: str
    bob: str
    approve: str
    deny: str
    cancel: str
    edit: str
    respond: str


@pytest.fixture(scope="session")
def seeded(tmp_path_factory) -> Seeded:
    url = str(tmp_path_factory.mktemp("ui") / "store")
    chatty = bound(url, "chatty_agent")
    chatty.run_sync("Tell me a story.", session_id="s-story", user_id="alice")
    chatty.run_sync("And then?", session_id="s-story", user_id="alice")
    first = chatty.list_checkpoints_sync("s-story", user_id="alice")[-1].checkpoint_id
    forks = [r.session_id for r in chatty.fork_sync("s-story", from_checkpoint=first, prompts=["try A", "try B"],
                                                    user_id="alice")]
    bound(url, "xss_agent").run_sync(f"repeat this: {ui_agents.XSS}", session_id="s-xss", user_id="alice")
    chatty.run_sync("Bob's secret plans.", session_id="s-bob-secret", user_id="bob")
    publisher = bound(url, "approval_agent")
    for sid in ("s-approve", "s-deny", "s-cancel", "s-edit", "s-respond"):
        assert publisher.run_sync("Publish Q3.", session_id=sid, user_id="alice").stop_reason == "awaiting_approval"
    return Seeded(url=url, fork_root="s-story", forks=forks, xss="s-xss", bob="s-bob-secret", approve="s-approve",
                  deny="s-deny", cancel="s-cancel", edit="s-edit", respond="s-respond")


class Server:
    """The app on uvicorn in a thread, on 127.0.0.1 and a free port."""

    def __init__(self, app: Any) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "the UI server to start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture(scope="session")
def servers(seeded) -> Iterator[dict[str, Server]]:
    """The open server (short streams: the browser reconnects every 2 s), one scoped to alice, one with a token."""
    made = {
        "open": Server(build_app(seeded.url, stream_s=2.0, poll_s=0.2)),
        "alice": Server(build_app(seeded.url, user_id="alice", poll_s=0.2)),
        "token": Server(build_app(seeded.url, token="s3cret-token", poll_s=0.2)),
    }
    yield made
    for s in made.values():
        s.stop()


@pytest.fixture(scope="module")  # not longer: while it is open, this thread runs Playwright's event loop
def browser(servers) -> Iterator[Any]:  # after the servers: Playwright runs an event loop in this thread
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"no Chromium at {CHROMIUM}: run .ci/ensure-browser")
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(15_000)
    yield pg
    context.close()
