"""The self-describing checkpoint object: an index header first, the caller's body, a digest last.

A checkpoint may be read before any index file names it, so the object
carries its index row and proves its own integrity::

    {"index":{...the row: CheckpointInfo fields, epoch...},
    ...the caller's JSON object, without its braces...,
    "sha256":"<sha256 of every byte before this member>"}

One JSON object (``jq`` works); the header is on the first line, so a reader
parses it without the body, which storage never looks inside. Objects the
removed one-at-a-time write path stored have no envelope: their index row
carries their size and sha256, and readers still read them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from datetime import datetime
from typing import Any

from . import layout
from .rows import CheckpointInfo, CheckpointRow, as_utc

HEADER = "index"
_OPEN = b'{"' + HEADER.encode() + b'":'
_TRAILER_HEAD = b',\n"sha256":"'
_TRAILER_LEN = len(_TRAILER_HEAD) + 64 + 2  # the member, 64 hex digits, the closing quote and brace
#: The header's fields: what the caller says about the checkpoint (then the writer's epoch).
INFO_FIELDS = [f.name for f in fields(CheckpointInfo)]


def wrap(body: bytes, header: dict[str, Any]) -> bytes:
    """``body`` (a JSON object's bytes) wrapped with ``header`` first and the digest last."""
    inner = body.strip()
    if not (inner.startswith(b"{") and inner.endswith(b"}")):
        raise ValueError("a checkpoint body must be one JSON object")
    inner = inner[1:-1].strip()
    head = _OPEN + json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    prefix = head + (b",\n" + inner if inner else b"\n")
    return prefix + _TRAILER_HEAD + hashlib.sha256(prefix).hexdigest().encode() + b'"}'


def is_enveloped(data: bytes) -> bool:
    """True when ``data`` starts like an enveloped checkpoint (older objects are plain JSON bodies)."""
    return data.startswith(_OPEN)


def header_of(data: bytes) -> dict[str, Any] | None:
    """The index header of an enveloped object (its first line only), or None when ``data`` is not one."""
    if not is_enveloped(data):
        return None
    end = data.find(b"\n")
    if end < 0:
        return None
    line = data[:end].rstrip(b",")
    try:
        doc = json.loads(line + b"}")
    except ValueError:
        return None
    header = doc.get(HEADER) if isinstance(doc, dict) else None
    return header if isinstance(header, dict) else None


def intact(data: bytes) -> bool:
    """True when an enveloped object's digest matches every byte before it (not truncated, not altered)."""
    if len(data) < _TRAILER_LEN or not is_enveloped(data):
        return False
    trailer = data[-_TRAILER_LEN:]
    if not (trailer.startswith(_TRAILER_HEAD) and trailer.endswith(b'"}')):
        return False
    return hashlib.sha256(data[:-_TRAILER_LEN]).hexdigest().encode() == trailer[len(_TRAILER_HEAD):-2]


def header_of_row(row: CheckpointRow) -> dict[str, Any]:
    """The envelope header of ``row``'s object: the caller's fields and the epoch (JSON types)."""
    head: dict[str, Any] = {}
    for name in INFO_FIELDS:
        value = getattr(row, name)
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, tuple):
            value = list(value)
        if value is not None and value != []:
            head[name] = value
    head["epoch"] = row.epoch
    return head


def row_of_header(header: dict[str, Any], key: str, data: bytes) -> CheckpointRow:
    """The index row an enveloped object's header describes (``ValueError``/``TypeError`` when malformed)."""
    values: dict[str, Any] = {name: header.get(name) for name in INFO_FIELDS}
    values["created_at"] = as_utc(datetime.fromisoformat(str(values["created_at"])))
    values["chain"] = tuple(str(r) for r in (values["chain"] or ()))
    for name in ("input_tokens", "output_tokens"):
        values[name] = int(values[name] or 0)
    epoch = header.get("epoch")
    if not layout.is_epoch(epoch):
        raise ValueError(f"epoch must be an integer in [0, 2**53), got {epoch!r:.40}")
    row = CheckpointRow(**values, epoch=epoch, key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    if layout.checkpoint_key(row.session_id, row.user_id, row.checkpoint_id) != key:
        raise ValueError(f"the header names checkpoint {row.checkpoint_id!r} of session {row.session_id!r}, "
                         f"not the object at {key}")
    return row
