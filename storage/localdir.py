"""Local-directory object store: one file per key under a root directory.

Writes go to a temporary next to their target (``%tmp-{hex}``: ids never
hold ``%``, so no key names one, and listings skip them), then appear
atomically: ``os.replace`` for a plain put, ``os.link`` (fails if the target
exists) for a create-only put, a compare-and-swap under ``flock`` on the
parent directory for ``if_match``. The ETag is ``mtime_ns-size-inode``.
Next to the target, not in one shared directory, because creating and
removing a file locks its directory: writers of different sessions then
touch different directories. Where Linux offers ``O_TMPFILE`` (with
``/proc``), a put whose target does not exist yet writes an unnamed file and
links it in place (``linkat``): one directory entry instead of three
changes, and nothing left behind by a writer killed mid-write
(docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import builtins
import fcntl
import os
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .errors import PreconditionFailed, StorageError
from .objects import ObjectInfo, ObjectStore, StoredObject

#: Where older versions kept every temporary; still never listed.
_TMP = ".tmp"
#: The name prefix of a temporary file (``%`` never occurs in an id, see :func:`storage.ids.validate_id`).
_TMP_PREFIX = "%tmp-"
#: Unnamed temporaries (Linux); cleared for the process when the system refuses one.
_UNNAMED = {"ok": hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")}
_slash: list[int] = []  # a directory fd (any: the path is absolute) makes os.link use linkat, which follows /proc


def _dir_fd() -> int:
    if not _slash:
        _slash.append(os.open("/", os.O_RDONLY))  # racing threads may open two; one stays unused
    return _slash[0]


def _etag(st: os.stat_result) -> str:
    return f'"{st.st_mtime_ns:x}-{st.st_size:x}-{st.st_ino:x}"'


class LocalObjectStore(ObjectStore):
    """Objects as files below ``root``; nothing is ever written outside it."""

    backend = "file"

    def __init__(self, root: str | os.PathLike, *, fsync: bool = False) -> None:
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync

    def _path(self, key: str) -> Path:
        # Keys come from validated ids; this is a second wall, not the first.
        if not key or key.startswith("/") or ".." in key.split("/") or key.split("/", 1)[0] == _TMP \
                or key.rsplit("/", 1)[-1].startswith(_TMP_PREFIX):
            raise StorageError(f"{self.describe(key)}: refusing a key outside the root")
        return self.root / key

    def _write_tmp(self, path: Path, data: bytes) -> Path:
        tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            if self._fsync:
                f.flush()
                os.fsync(f.fileno())
        return tmp

    def _link_new(self, path: Path, data: bytes) -> str | None:
        """Write ``data`` to an unnamed file in ``path``'s directory, link it at ``path`` and return its ETag; None
        when the system has no unnamed files (then the caller uses a named temporary). Raises ``FileExistsError``
        when ``path`` exists, ``FileNotFoundError`` when its directory does not."""
        if not _UNNAMED["ok"]:
            return None
        try:
            fd = os.open(path.parent, os.O_TMPFILE | os.O_WRONLY, 0o666)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(path.parent) from None
        except OSError:  # the file system has no unnamed files (EOPNOTSUPP, EISDIR, EINVAL)
            _UNNAMED["ok"] = False
            return None
        try:
            with open(fd, "wb", closefd=False) as f:
                f.write(data)
                if self._fsync:
                    f.flush()
                    os.fsync(fd)
            try:
                os.link(f"/proc/self/fd/{fd}", path, src_dir_fd=_dir_fd())
            except (FileExistsError, FileNotFoundError):
                raise
            except OSError:  # no linkat through /proc here (a sandbox): named temporaries from now on
                _UNNAMED["ok"] = False
                return None
            # This very file's (a link changes neither its mtime nor its size), however soon it is replaced.
            return _etag(os.fstat(fd))
        finally:
            os.close(fd)

    def put(self, *, key: str, data: bytes, if_none_match: bool = False, if_match: str | None = None) -> str:
        path = self._path(key)
        for attempt in range(3):
            tmp = None
            try:
                if if_match is None:
                    try:
                        etag = self._link_new(path, data)
                        if etag is not None:
                            return etag
                    except FileExistsError as e:
                        if if_none_match:
                            raise PreconditionFailed(f"{self.describe(key)} already exists (create-only put)") from e
                tmp = self._write_tmp(path, data)
                return self._publish(path, tmp, key, if_none_match, if_match)
            except FileNotFoundError:
                # The directory is missing: never made, or a concurrent delete removed it (then empty).
                if attempt == 2:
                    raise
                path.parent.mkdir(parents=True, exist_ok=True)
            finally:
                if tmp is not None:
                    tmp.unlink(missing_ok=True)
        raise AssertionError("unreachable")

    def _publish(self, path: Path, tmp: Path, key: str, if_none_match: bool, if_match: str | None) -> str:
        if if_none_match:
            try:
                os.link(tmp, path)  # atomic exclusive create with the full content
            except FileExistsError as e:
                raise PreconditionFailed(f"{self.describe(key)} already exists (create-only put)") from e
            return _etag(path.stat())
        if if_match is None:
            os.replace(tmp, path)
            return _etag(path.stat())
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # serialises compare-and-swap across processes
            try:
                current = _etag(path.stat())
            except FileNotFoundError:
                current = None
            if current != if_match:
                raise PreconditionFailed(f"{self.describe(key)} changed since ETag {if_match} (compare-and-swap put)")
            os.replace(tmp, path)
            return _etag(path.stat())
        finally:
            os.close(fd)  # closing releases the flock

    def get(self, *, key: str) -> StoredObject | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                return StoredObject(f.read(), _etag(st))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def list(self, *, prefix: str) -> Iterator[ObjectInfo]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base if base else self.root
        hits: list[ObjectInfo] = []  # os.walk of a missing directory (or a file) yields nothing
        for dirpath, dirnames, filenames in os.walk(start):
            rel_dir = os.path.relpath(dirpath, self.root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            if rel_dir == "":
                dirnames[:] = [d for d in dirnames if d != _TMP]
            # Prune directories that cannot hold a match, so a session LIST stays a session LIST.
            dirnames[:] = [d for d in dirnames if (rel_dir + d + "/").startswith(prefix) or prefix.startswith(rel_dir + d + "/")]
            for name in filenames:
                key = rel_dir + name
                if not key.startswith(prefix) or name.startswith(_TMP_PREFIX):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # deleted while listing
                hits.append(ObjectInfo(key, st.st_size, _etag(st), datetime.fromtimestamp(st.st_mtime, timezone.utc)))
        hits.sort(key=lambda o: o.key)
        yield from hits

    def list_dirs(self, *, prefix: str) -> builtins.list[str]:
        start = self.root / prefix if prefix else self.root
        try:
            entries = list(os.scandir(start))
        except (FileNotFoundError, NotADirectoryError):
            return []
        # delete() removes emptied directories, so a directory here holds objects.
        return sorted(e.name for e in entries if e.is_dir() and e.name != _TMP)

    def delete(self, *, keys: builtins.list[str]) -> None:
        for key in keys:
            path = self._path(key)
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            # S3 has no directories; remove emptied ones so listings of sessions match.
            parent = path.parent
            while parent != self.root:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    def fsspec(self) -> tuple[Any, str]:
        try:
            import fsspec  # the [fsspec] extra: loads only when an outside reader asks for it
        except ImportError as e:
            raise ImportError("Store.fsspec() needs fsspec: pip install 'loomray[fsspec]'") from e

        return fsspec.filesystem("file"), str(self.root)

    def describe(self, key: str | None = None) -> str:
        where = f"file://{self.root}"
        return where if key is None else f"{where} key {key!r}"
