"""Test doubles that ship with the library: a moto S3 server on loopback and a fault injector.

``MotoS3Server`` runs moto's ``ThreadedMotoServer`` on 127.0.0.1 (a free
port), hands out fresh buckets so tests are isolated, and builds store URLs
and options. ``FaultInjector`` hooks a boto3 client's ``before-send`` event and
fails the next N requests like a real network or an overloaded S3 would
(503 SlowDown, connection reset, read timeout); botocore's own retry logic
sees them exactly as it sees real failures.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from storage.store import Store

CREDENTIALS = {"key": "testing", "secret": "testing", "region": "us-east-1"}


class MotoS3Server:
    """moto's S3 on ``127.0.0.1:{free port}``; ``start()`` / ``stop()`` or use as a context manager."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        # werkzeug logs every request line; tests and benches only want failures.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint_url = ""
        self._client = None

    def start(self) -> MotoS3Server:
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        self._server.stop()

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
            import boto3

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
        from storage import open_store

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
        from botocore.awsrequest import AWSResponse
        from botocore.exceptions import ConnectionClosedError, ReadTimeoutError

        if self.kind == "reset":
            raise ConnectionClosedError(endpoint_url=request.url)
        if self.kind == "timeout":
            raise ReadTimeoutError(endpoint_url=request.url)
        status, code = {"slowdown": (503, "SlowDown"), "unavailable": (503, "ServiceUnavailable"),
                        "denied": (403, "AccessDenied")}[self.kind]
        body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _RawBody(body))
