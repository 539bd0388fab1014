"""Suite-wide setup: Ray binds to loopback, and no test reaches the network; each test process (an xdist
worker under ``make test``'s ``-n 2``) has a Ray temp dir of its own, and gets whole test modules."""

import os
import shutil as _shutil
import tempfile as _tempfile
import uuid as _uuid

import pytest as _pytest

# Must be set before Ray starts anywhere in this process or its children.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Make sure no real AWS credentials or endpoints leak into tests.
for _var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN"):
    os.environ.pop(_var, None)
# Ray's temp dir (its sessions, sockets, and the "current cluster" file that a ray.init() without an address
# connects to) for this process and its children alone: a cluster that another test process on the machine
# starts (the other xdist worker) is never the one found there. Short: Ray's socket paths live under it.
_RAY_TMPDIR = _tempfile.mkdtemp(prefix="lr-", dir=os.environ.get("RAY_TMPDIR", "/tmp"))
os.environ["RAY_TMPDIR"] = _RAY_TMPDIR


def pytest_unconfigure(config):
    _shutil.rmtree(_RAY_TMPDIR, ignore_errors=True)


@_pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist, whole modules go to a worker, in collection order, whatever ``--dist`` says: a
    module's clusters, servers and browser start once, in one worker, and a worker that has connected to the
    shared Ray cluster (tests/ray/conftest.py, whose modules are collected last) is never handed a module that
    connects to a cluster of its own (xdist's loadfile would hand out the biggest modules first)."""
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)


# --- storage fixtures (shared: any test may ask for `store`, `s3_server`, `s3_store_url`) ---

@_pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (free port) for the whole test session."""
    from loomray.storage.testing import MotoS3Server

    server = MotoS3Server().start()
    yield server
    server.stop()


@_pytest.fixture
def s3_store_url(s3_server, monkeypatch):
    """``s3://{fresh bucket}/root`` with endpoint and credentials in the environment (AWS_ENDPOINT_URL...)."""
    bucket = s3_server.new_bucket()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    return f"s3://{bucket}/root"


@_pytest.fixture(params=["memory", "local", "s3"])
def store(request, tmp_path):
    """A fresh, empty ``storage.Store`` on each backend: memory, a local directory, S3 (moto)."""
    from loomray.storage import open_store

    if request.param == "memory":
        st = open_store(f"memory://{_uuid.uuid4().hex}")
    elif request.param == "local":
        st = open_store(tmp_path / "store")
    else:
        st = request.getfixturevalue("s3_server").open_store()
    yield st
    st.close()
