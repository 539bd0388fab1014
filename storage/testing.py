"""Test doubles that ship with the library: a moto S3 server on loopback, a fault injector, suite helpers.

``MotoS3Server`` runs moto's ``ThreadedMotoServer`` on 127.0.0.1 (a free
port), hands out fresh buckets so tests are isolated, and builds store URLs
and options. ``FaultInjector`` hooks a boto3 client's ``before-send`` event and
fails the next N requests like a real network or an overloaded S3 would
(503 SlowDown, connection reset, read timeout); botocore's own retry logic
sees them exactly as it sees real failures. The functions at the end write
the checkpoints and journal entries the conformance suite
(:mod:`storage.conformance`) works with.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import threading
import uuid
import weakref
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
import pyarrow as pa
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ConnectionClosedError, ReadTimeoutError

from . import layout, open_store
from .checkpoint_log import CheckpointLog
from .rows import CheckpointInfo, CheckpointRow, JournalEntry, Lease, as_utc
from .store import Store

CREDENTIALS = {"key": "testing", "secret": "testing", "region": "us-east-1"}

#: ``MotoS3Server(own_process=True)``'s child: serve on a free loopback port, print it, stop at end of stdin.
_CHILD_SERVER = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""


class MotoS3Server:
    """moto's S3 on ``127.0.0.1:{free port}``; ``start()`` / ``stop()`` or use as a context manager."""

    def __init__(self, *, own_process: bool = False) -> None:
        """``own_process=True`` runs the server in a child process, as a real S3 endpoint is: its request
        handling does not share the client's interpreter lock (what benches measure overlap with)."""
        self.own_process = own_process
        self._server: Any = None
        self._child: subprocess.Popen | None = None
        if not own_process:
            from moto.server import ThreadedMotoServer  # moto is a test dependency, needed only by this server

            # werkzeug logs every request line; tests and benches only want failures.
            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint_url = ""
        self._client = None

    def start(self) -> MotoS3Server:
        if self._server is not None:
            self._server.start()
            host, port = self._server.get_host_and_port()
        else:
            self._child = subprocess.Popen([sys.executable, "-c", _CHILD_SERVER], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True)
            assert self._child.stdout is not None
            line = self._child.stdout.readline().strip()
            if not line:
                raise RuntimeError(f"moto's server process exited ({self._child.wait()}) before it listened")
            host, port = "127.0.0.1", int(line)
        self.endpoint_url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._server is not None:
            self._server.stop()
        elif self._child is not None:
            assert self._child.stdin is not None
            self._child.stdin.close()  # the child stops its server and exits at end of input
            self._child.wait(timeout=30)

    def __enter__(self) -> MotoS3Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def options(self) -> dict[str, Any]:
        """``open_store`` options for this server."""
        return {"endpoint_url": self.endpoint_url, **CREDENTIALS}

    def client(self):
        """A plain boto3 client on this server (for test setup and inspection)."""
        if self._client is None:
            self._client = boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id="testing",
                                        aws_secret_access_key="testing", region_name="us-east-1")
        return self._client

    def new_bucket(self, prefix: str = "test") -> str:
        """Create and return a fresh, uniquely named bucket."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def open_store(self, bucket: str | None = None, prefix: str = "root", **options: Any) -> Store:
        """A store on a fresh bucket (or ``bucket``) under ``prefix``."""
        bucket = bucket or self.new_bucket()
        return open_store(f"s3://{bucket}/{prefix}", **{**self.options, **options})


class _RawBody:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any):
        yield self._body


class FaultInjector:
    """Fail the next ``failures`` S3 requests of a boto3 client (optionally only ``operations``).

    ``kind``: "slowdown" (503 SlowDown), "unavailable" (503 ServiceUnavailable),
    "reset" (connection reset), "timeout" (read timeout), "denied" (403, not retryable).
    ``failures=None`` fails forever. ``seen`` counts requests, ``injected`` faults.
    """

    def __init__(self, client: Any, *, failures: int | None = 1, kind: str = "slowdown",
                 operations: set[str] | None = None) -> None:
        if kind not in ("slowdown", "unavailable", "reset", "timeout", "denied"):
            raise ValueError(f"unknown fault kind {kind!r}")
        self.client = client
        self.remaining = failures
        self.kind = kind
        self.operations = operations
        self.seen = 0
        self.injected = 0
        self._lock = threading.Lock()
        self._unique = f"fault-injector-{id(self)}"
        client.meta.events.register("before-send.s3", self._before_send, unique_id=self._unique)

    def remove(self) -> None:
        """Stop injecting."""
        self.client.meta.events.unregister("before-send.s3", unique_id=self._unique)

    def _before_send(self, request: Any, event_name: str = "", **_: Any):
        op = event_name.rsplit(".", 1)[-1]
        with self._lock:
            self.seen += 1
            if self.operations is not None and op not in self.operations:
                return None
            if self.remaining is not None:
                if self.remaining <= 0:
                    return None
                self.remaining -= 1
            self.injected += 1
        if self.kind == "reset":
            raise ConnectionClosedError(endpoint_url=request.url)
        if self.kind == "timeout":
            raise ReadTimeoutError(endpoint_url=request.url)
        status, code = {"slowdown": (503, "SlowDown"), "unavailable": (503, "ServiceUnavailable"),
                        "denied": (403, "AccessDenied")}[self.kind]
        body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _RawBody(body))


# -- helpers of the conformance suite (storage.conformance) and of tests built on it ------------------
T0 = datetime(2026, 7, 4, 12, 0, tzinfo=timezone.utc)


#: The checkpoint log :func:`write_checkpoint` writes through, per store and (session, user, epoch, keep).
_LOGS: weakref.WeakKeyDictionary[Store, dict[tuple[str, str | None, int, int], CheckpointLog]] = (
    weakref.WeakKeyDictionary())


def write_checkpoint(store: Store, data: bytes, info: CheckpointInfo, *, lease: Lease | None = None,
                     keep: int = 20) -> CheckpointRow:
    """Write one checkpoint the way runs do, through ``store.checkpoints.log(lease)``, and acknowledge it at
    once (a batch of one); returns its row. Successive writes of one lease share a log, as a run's do (so the
    objects one write's retention retired go with the next write). ``lease`` None: epoch 0, the lease of a
    session nobody has leased yet (a leased session refuses it with :class:`LeaseLostError`)."""
    if lease is None:
        lease = Lease(session_id=info.session_id, user_id=info.user_id, epoch=0, owner="test writer")
    logs = _LOGS.setdefault(store, {})
    log = logs.get((lease.session_id, lease.user_id, lease.epoch, keep))
    if log is None or log.lease != lease:
        log = logs[(lease.session_id, lease.user_id, lease.epoch, keep)] = store.checkpoints.log(lease, keep=keep,
                                                                                                  batch=1)
    rows = log.put(data, info) or log.flush()  # put returns [] when its index write failed: flush retries it
    for row in rows:
        if row.checkpoint_id == info.checkpoint_id:
            return row
    # Indexed by a flush that failed after its index file (collection): the index has its row.
    return store.checkpoints.rows(info.session_id, user_id=info.user_id)[info.checkpoint_id]


def land_row(store: Store, data: bytes, info: CheckpointInfo, *, epoch: int) -> CheckpointRow:
    """Land a checkpoint object and its index row at ``epoch`` with no lease check: what a writer that was
    fenced meanwhile leaves (an older release wrote its rows one by one, after a lease check a takeover could
    race), so that tests can check that every reader hides such a row. Not a write path."""
    key = layout.checkpoint_key(info.session_id, info.user_id, info.checkpoint_id)
    row = CheckpointRow(**{**info.__dict__, "created_at": as_utc(info.created_at)}, epoch=epoch, key=key,
                        size=len(data), sha256=hashlib.sha256(data).hexdigest())
    store.objects.put(key=key, data=data)
    store._rows.write(info.session_id, info.user_id, [row], tombstone=False)
    return row


def write_index_file(store: Store, partition: str, table: pa.Table) -> str:
    """Append ``table`` to the index as one file under ``partition`` with no check of its rows: what an older
    release, a bench's bulk fill or someone with write access to the bucket may leave; returns its key."""
    return store._index.write(partition, table, cache=False)


def put_checkpoint(store: Store, session_id: str, checkpoint_id: str, *, user_id=None, turn=1, keep=20, lease=None,
                   status="active", cost=0.01, created_at=None, payload=None) -> CheckpointRow:
    """Write a checkpoint whose row fields follow from ``turn`` (created ``turn`` minutes after ``T0``) with
    :func:`write_checkpoint`."""
    data = payload if payload is not None else json.dumps({"session_id": session_id, "checkpoint_id": checkpoint_id,
                                                           "turn": turn}).encode()
    info = CheckpointInfo(session_id=session_id, checkpoint_id=checkpoint_id, user_id=user_id, turn=turn,
                          created_at=created_at or T0 + timedelta(minutes=turn), position="after_tools",
                          execution_status=status, message_count=2 * turn, input_tokens=10 * turn,
                          output_tokens=turn, cost_usd=cost)
    return write_checkpoint(store, data, info, lease=lease, keep=keep)


def log_put(log: CheckpointLog, checkpoint_id: str, *, turn: int = 1, chain: tuple[str, ...] = (),
            payload: bytes | None = None) -> list[CheckpointRow]:
    """Put a checkpoint through ``log`` (of its lease's session), row fields following from ``turn`` as in
    :func:`put_checkpoint`; returns the rows the put acknowledged."""
    lease = log.lease
    data = payload if payload is not None else json.dumps({"turn": turn, "text": f"pass {turn}"}).encode()
    info = CheckpointInfo(session_id=lease.session_id, checkpoint_id=checkpoint_id, user_id=lease.user_id,
                          turn=turn, created_at=T0 + timedelta(minutes=turn), position="after_tools",
                          execution_status="active", message_count=2 * turn, input_tokens=10 * turn,
                          output_tokens=turn, cost_usd=0.01, chain=chain)
    return log.put(data, info)


def all_keys(store: Store) -> list[str]:
    """Every object key in the store."""
    return [o.key for o in store.objects.list(prefix="")]


def journal_entry(seq, step, run="run1", kind="model", user_id=None, created_at=None) -> JournalEntry:
    """A journal entry of session ``s1`` created ``seq`` seconds after ``T0``."""
    return JournalEntry(session_id="s1", user_id=user_id, run_id=run, seq=seq, step_key=step, kind=kind,
                        input_hash=f"h{seq}", output={"text": f"out {seq}", "n": [seq]},
                        created_at=created_at or T0 + timedelta(seconds=seq))


def fill_sessions(store: Store) -> None:
    """Three checkpoints in each of sessions s1 and s2 of no user, alice and bob."""
    for u in (None, "alice", "bob"):
        for s in ("s1", "s2"):
            for i in range(3):
                put_checkpoint(store, s, f"c{i}", user_id=u, turn=i, cost=0.5 * i, keep=0,
                               status="completed" if i == 2 else "active")
