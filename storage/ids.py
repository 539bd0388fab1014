"""Id validation: an id becomes one path segment of an object key, never a path.

Rules: a non-empty ``str`` of at most 128 characters, with no ``/`` or ``\\``,
no ``..``, no control characters (C0, DEL, C1), and not ``.`` itself. The user
segment ``_`` stands for "no user", so ``_`` is refused as a user id.
"""

from __future__ import annotations

import re

from storage.errors import InvalidIdError

MAX_ID_LENGTH = 128
NO_USER = "_"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def validate_id(value: object, what: str = "id") -> str:
    """Return ``value`` if it is a safe key segment, else raise :class:`InvalidIdError`."""
    if not isinstance(value, str):
        raise InvalidIdError(f"{what} must be a str, got {type(value).__name__}")
    if not value:
        raise InvalidIdError(f"{what} must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidIdError(f"{what} is {len(value)} characters long; the limit is {MAX_ID_LENGTH}")
    if "/" in value or "\\" in value:
        raise InvalidIdError(f"{what} {value!r} must not contain '/' or '\\'")
    if ".." in value or value == ".":
        raise InvalidIdError(f"{what} {value!r} must not contain '..' or be '.'")
    if _CONTROL.search(value):
        raise InvalidIdError(f"{what} {value!r} must not contain control characters")
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
