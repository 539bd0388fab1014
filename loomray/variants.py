"""What a fork may change from its base: :class:`Variant` and its transcript :class:`Edit` s.

A variant is plain data, so that it can be stored with the fork it made and
read back by whichever process continues that fork after a crash. Fields left
``None`` keep the base agent's value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from loomray.config import Tuning
from loomray.records import Message


@dataclass(frozen=True)
class Edit:
    """One change to the transcript at the fork point; the base session's transcript is never touched.

    Build them with :meth:`replace`, :meth:`drop` and :meth:`insert`. ``index``
    counts messages of the checkpoint the fork starts from (negative counts
    from the end, as in Python); edits apply in the order given, each to the
    result of the one before.
    """

    op: Literal["replace", "drop", "insert"]
    index: int
    message: Message | None = None

    def __post_init__(self) -> None:
        if self.op not in ("replace", "drop", "insert"):
            raise ValueError(f"Edit.op must be 'replace', 'drop' or 'insert', got {self.op!r}")
        if type(self.index) is not int:
            raise TypeError(f"Edit.index must be an int, got {type(self.index).__name__}")
        if (self.op == "drop") != (self.message is None):
            raise ValueError(f"Edit.{self.op} takes {'no message' if self.op == 'drop' else 'a Message'}")
        if self.message is not None and not isinstance(self.message, Message):
            raise TypeError(f"Edit.message must be a loomray.Message, got {type(self.message).__name__}")

    @classmethod
    def replace(cls, index: int, message: Message) -> Edit:
        """Put ``message`` in place of the message at ``index``."""
        return cls("replace", index, message)

    @classmethod
    def drop(cls, index: int) -> Edit:
        """Remove the message at ``index``."""
        return cls("drop", index)

    @classmethod
    def insert(cls, index: int, message: Message) -> Edit:
        """Insert ``message`` before the message at ``index`` (``len`` appends)."""
        return cls("insert", index, message)


@dataclass(frozen=True)
class Variant:
    """How one fork differs from its base agent; ``None`` keeps the base's value.

    - ``prompt``: the user turn the fork starts with (None: "Continue the interrupted task.").
    - ``model``: a model name (resolved as ``Agent(model=...)`` resolves one) or a ``Model``.
    - ``instructions``: the system instructions.
    - ``tools``: the fork's tools, as for ``Agent(tools=...)``.
    - ``tuning``: a :class:`~loomray.Tuning` for the fork (temperature, effort, budgets, ...).
    - ``edits``: :class:`Edit` s applied to the checkpoint's transcript at the fork point.
    """

    prompt: str | None = None
    model: Any = None
    instructions: str | None = None
    tools: tuple[Any, ...] | None = None
    tuning: Tuning | None = None
    edits: tuple[Edit, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise TypeError(f"Variant.prompt must be a str or None, got {type(self.prompt).__name__}")
        if self.instructions is not None and not isinstance(self.instructions, str):
            raise TypeError(f"Variant.instructions must be a str or None, got {type(self.instructions).__name__}")
        if self.tuning is not None and not isinstance(self.tuning, Tuning):
            raise TypeError(f"Variant.tuning must be a loomray.Tuning, got {type(self.tuning).__name__}")
        if self.tools is not None:
            if isinstance(self.tools, (str, bytes)):
                raise TypeError("Variant.tools must be a list of tools, not one string")
            object.__setattr__(self, "tools", tuple(self.tools))
        edits = () if self.edits is None else self.edits
        if not all(isinstance(e, Edit) for e in edits):
            raise TypeError("Variant.edits must be a list of loomray.Edit")
        object.__setattr__(self, "edits", tuple(edits))
