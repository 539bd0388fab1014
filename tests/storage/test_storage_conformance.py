"""The storage conformance suite (:mod:`storage.conformance`) on every backend: memory, a local directory, S3 (moto)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from loomray.storage import Store, open_store
from loomray.storage.conformance import ObjectStoreConformance


class TestMemory(ObjectStoreConformance):
    def make_store(self, tmp_path: Path) -> Store:
        return open_store(f"memory://{uuid.uuid4().hex}")


class TestLocalDirectory(ObjectStoreConformance):
    def make_store(self, tmp_path: Path) -> Store:
        return open_store(tmp_path / "store")


class TestS3(ObjectStoreConformance):
    atomic_conditional_writes = False  # moto checks If-None-Match / If-Match, then puts: not atomic

    @pytest.fixture(autouse=True)
    def _server(self, s3_server):
        self.server = s3_server

    def make_store(self, tmp_path: Path) -> Store:
        return self.server.open_store()
