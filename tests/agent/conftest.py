"""Fixtures for the agent suite: runtimes on every backend, and small fault-injecting store wrappers."""

from __future__ import annotations

import pytest
from agent_helpers import tool_calls

from loomray.runtime import InProcRuntime, LocalRuntime


@pytest.fixture(autouse=True)
def _no_lookups_yet():
    """Every test starts with no ``agent_helpers.lookup`` call counted."""
    tool_calls.clear()


@pytest.fixture(params=["inproc", "local", "s3"])
def runtime_factory(request, tmp_path):
    """Builds runtimes that share one backend per test: memory, a local directory, or S3 (moto)."""
    made = []
    inproc_store = []

    def make(max_checkpoints_per_session: int = 20):
        if request.param == "inproc":
            rt = InProcRuntime(max_checkpoints_per_session=max_checkpoints_per_session)
            if inproc_store:  # share state between runtimes of one test, as a directory would
                rt.store = inproc_store[0]
            else:
                inproc_store.append(rt.store)
        elif request.param == "local":
            rt = LocalRuntime(tmp_path / "data", max_checkpoints_per_session=max_checkpoints_per_session)
        else:
            server = request.getfixturevalue("s3_server")
            if not made:
                bucket = server.new_bucket("agent")
                make.url = f"s3://{bucket}/root"
            rt = LocalRuntime(make.url, max_checkpoints_per_session=max_checkpoints_per_session, **server.options)
        made.append(rt)
        return rt

    make.backend = request.param
    yield make
    closed = set()
    for rt in made:
        if id(rt.store) not in closed:
            closed.add(id(rt.store))
            rt.close()


@pytest.fixture
def runtime(runtime_factory):
    """One runtime on each backend."""
    return runtime_factory()


class StoreWrapper:
    """Delegates to a real store; subclasses override one sub-store to count or fail (fault injection)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Delegate:
    """Delegates to a real sub-store; a subclass overrides what it injects faults into."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


class FailingCheckpoints(StoreWrapper):
    """Checkpoint writes (``put`` of the checkpoint logs ``store.checkpoints.log`` opens) fail ``failures`` times
    (None = always) with an OSError."""

    def __init__(self, inner, failures=None):
        super().__init__(inner)
        self.failures = failures
        self.attempts = 0
        self.checkpoints = _FailingLogs(inner.checkpoints, self)

    def _attempt(self):
        self.attempts += 1
        if self.failures is None or self.failures > 0:
            if self.failures is not None:
                self.failures -= 1
            raise OSError("disk full (injected)")


class _FailingLogs(_Delegate):
    def __init__(self, inner, owner):
        super().__init__(inner)
        self._owner = owner

    def log(self, lease, **kw):
        log = self._inner.log(lease, **kw)
        real = log.put

        def put(data, info):
            self._owner._attempt()
            return real(data, info)

        log.put = put
        return log


@pytest.fixture
def failing_checkpoints():
    """The :class:`FailingCheckpoints` wrapper class (tests wrap ``runtime.store`` with it)."""
    return FailingCheckpoints
