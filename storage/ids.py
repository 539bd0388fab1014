"""Id validation: an id becomes one path segment of an object key, never a path.

Rules: a non-empty ``str`` of at most 128 bytes in UTF-8 (file systems and S3
limit key segments in bytes, not characters), with no ``/`` or ``\\``, no
``..``, and not ``.`` itself; no ``=`` (hive partition directories are
``session={id}``, and a second ``=`` breaks DuckDB's and pyarrow's reading of
the whole index) and no ``%`` (outside readers may URL-decode keys); no control
characters (C0, DEL, C1), no Unicode format characters (category Cf: bidi
controls such as U+202E, zero-width characters, BOM), no line or paragraph
separators and no lone surrogates: an id printed in a terminal shows what it
is. The user segment ``_`` stands for "no user", so ``_`` is refused as a user
id.
"""

from __future__ import annotations

import re
import unicodedata

from .errors import InvalidIdError

#: The limit is in UTF-8 bytes.
MAX_ID_LENGTH = 128
NO_USER = "_"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_RESERVED = ("=", "%")
# Cf: format (bidi controls, zero-width, BOM); Zl/Zp: line/paragraph separators; Cs: lone surrogates.
_UNSAFE_CATEGORIES = frozenset({"Cf", "Zl", "Zp", "Cs"})


def validate_id(value: object, what: str = "id") -> str:
    """Return ``value`` if it is a safe key segment, else raise :class:`InvalidIdError`."""
    if not isinstance(value, str):
        raise InvalidIdError(f"{what} must be a str, got {type(value).__name__}")
    if not value:
        raise InvalidIdError(f"{what} must not be empty")
    if "/" in value or "\\" in value:
        raise InvalidIdError(f"{what} {value!r} must not contain '/' or '\\'")
    if ".." in value or value == ".":
        raise InvalidIdError(f"{what} {value!r} must not contain '..' or be '.'")
    for ch in _RESERVED:
        if ch in value:
            raise InvalidIdError(f"{what} {value!r} must not contain {ch!r} (it breaks hive-partitioned "
                                 "or URL-decoding readers of the store)")
    if _CONTROL.search(value):
        raise InvalidIdError(f"{what} {value!r} must not contain control characters")
    if not value.isascii():
        bad = next((ch for ch in value if unicodedata.category(ch) in _UNSAFE_CATEGORIES), None)
        if bad is not None:
            raise InvalidIdError(f"{what} {value!r} must not contain invisible or text-direction characters "
                                 f"(U+{ord(bad):04X}, Unicode category {unicodedata.category(bad)})")
        size = len(value.encode("utf-8"))
    else:
        size = len(value)
    if size > MAX_ID_LENGTH:
        raise InvalidIdError(f"{what} is {size} bytes long in UTF-8; the limit is {MAX_ID_LENGTH} bytes")
    return value


def user_segment(user_id: str | None) -> str:
    """The key segment of ``user_id``: ``_`` for no user; ``_`` itself is not a valid user id."""
    if user_id is None:
        return NO_USER
    validate_id(user_id, "user_id")
    if user_id == NO_USER:
        raise InvalidIdError(f"user_id {NO_USER!r} is reserved for 'no user'; pass None instead")
    return user_id


def user_from_segment(segment: str) -> str | None:
    """Inverse of :func:`user_segment`."""
    return None if segment == NO_USER else segment
