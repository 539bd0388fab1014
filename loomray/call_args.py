"""What :class:`~loomray.Agent`'s methods check and split of their arguments before anything runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from loomray.errors import InvalidIdError, LoomrayUserError
from loomray.events import EmitFn
from loomray.storage.errors import InvalidIdError as StorageInvalidIdError
from loomray.storage.ids import user_segment, validate_id


def check_id(value: object, what: str) -> str:
    """``value`` if it is a valid id, else :class:`InvalidIdError` (also a ``ValueError``)."""
    try:
        return validate_id(value, what)
    except StorageInvalidIdError as e:
        raise InvalidIdError(str(e)) from e


def check_user(user_id: Any) -> None:
    """Refuse an invalid user id (None is the default user)."""
    if user_id is not None:
        try:
            user_segment(user_id)
        except StorageInvalidIdError as e:
            raise InvalidIdError(str(e)) from e


def check_ids(session_id: object, user_id: object, checkpoint_id: str = "latest") -> None:
    """Refuse invalid ids before anything runs (``""`` is not "no id": only None is)."""
    check_id(session_id, "session_id")
    check_user(user_id)
    if checkpoint_id != "latest":
        check_id(checkpoint_id, "checkpoint_id")


_RUN_FIELDS = ("metadata", "context", "effort")


def split_kwargs(kwargs: dict[str, Any]) -> tuple[EmitFn | None, Sequence[Any], Any, dict[str, Any]]:
    """``run``'s keyword arguments passed on by ``resume`` and ``fork``: emit, extra tools, output schema, fields."""
    unknown = set(kwargs) - {"emit", "extra_tools", "output_schema", *_RUN_FIELDS}
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {sorted(unknown)}")
    fields = {k: kwargs[k] for k in _RUN_FIELDS if k in kwargs}
    return kwargs.get("emit"), kwargs.get("extra_tools", ()), kwargs.get("output_schema"), fields


def output_type(output_schema: object) -> type[BaseModel] | None:
    """The pydantic class ``output_schema`` names (None for a JSON schema dict or none); anything else is refused."""
    if output_schema is None:
        return None
    if isinstance(output_schema, type) and issubclass(output_schema, BaseModel):
        return output_schema
    if isinstance(output_schema, dict):
        return None
    raise LoomrayUserError(f"output_schema must be a pydantic model class or a JSON schema dict, got {output_schema!r}")


def schema(output_schema: object) -> dict[str, Any] | None:
    """``output_schema`` as the JSON schema a request carries (None without one)."""
    t = output_type(output_schema)
    if t is not None:
        return t.model_json_schema()
    return output_schema if isinstance(output_schema, dict) else None
