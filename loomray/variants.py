"""What a fork may change from its base: :class:`Variant` and its transcript :class:`Edit` s.

A variant is plain data, stored as JSON with the fork it made (model and tools by name), so whichever
process continues the fork rebuilds the same agent against the base (:func:`agent_for`); docs/forks.md,
"Stored with the fork".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from loomray.config import RENAMED_FIELDS, CheckpointConfig, Tuning
from loomray.errors import LoomrayUserError
from loomray.models.base import Model
from loomray.models.resolve import resolve_model
from loomray.records import Message
from loomray.tools import Tool, as_tools


class VariantError(LoomrayUserError):
    """A variant cannot apply: an edit's index is outside the transcript, or its stored form cannot be rebuilt."""


@dataclass(frozen=True)
class Edit:
    """One change to the transcript at the fork point (:meth:`replace`, :meth:`drop`, :meth:`insert`).

    ``index`` counts as Python's lists do; edits apply in order, each to the result of the one before.
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

    def to_json(self) -> dict[str, Any]:
        """The edit as stored: ``{"op", "index"}`` plus ``"message"`` (a Message's JSON) unless it drops."""
        out: dict[str, Any] = {"op": self.op, "index": self.index}
        if self.message is not None:
            out["message"] = self.message.model_dump(mode="json", exclude_defaults=True)
        return out

    @classmethod
    def from_json(cls, data: Any) -> Edit:
        """The edit :meth:`to_json` stored; :class:`VariantError` for anything else."""
        try:
            message = data.get("message")
            return cls(data["op"], data["index"], None if message is None else Message.model_validate(message))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise VariantError(f"not a stored transcript edit: {data!r:.120}") from e

    def describe(self) -> str:
        """A few words: ``replace 3``, ``drop -1``, ``insert 2 (user)``."""
        return f"{self.op} {self.index}" + (f" ({self.message.role})" if self.message is not None else "")


@dataclass(frozen=True)
class Variant:
    """How one fork differs from its base agent (prompt, model, instructions, tools, tuning, edits); ``None``
    keeps the base's value (a ``None`` prompt: "Continue the interrupted task.")."""

    prompt: str | None = None
    model: str | Model | None = None
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

    def to_json(self) -> dict[str, Any]:
        """The variant as stored with its fork: only the fields it sets; model and tools by name."""
        out: dict[str, Any] = {}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        if self.model is not None:
            out["model"] = self.model if isinstance(self.model, str) else str(self.model.name)
        if self.instructions is not None:
            out["instructions"] = self.instructions
        if self.tools is not None:
            out["tools"] = [t if isinstance(t, str) else t.name if isinstance(t, Tool) else Tool(t).name
                            for t in self.tools]
        if self.tuning is not None:
            out["tuning"] = dataclasses.asdict(self.tuning)
        if self.edits:
            out["edits"] = [e.to_json() for e in self.edits]
        return out

    @classmethod
    def from_json(cls, data: object) -> Variant:
        """The variant :meth:`to_json` stored: model and tools as names. :class:`VariantError` for anything else."""
        if not isinstance(data, dict):
            raise VariantError(f"a stored variant is a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"prompt", "model", "instructions", "tools", "tuning", "edits"}
        if unknown:
            raise VariantError(f"a stored variant has unknown field(s) {sorted(unknown)}")
        if not isinstance(data.get("model", ""), str) or not isinstance(data.get("tools", []), list):
            raise VariantError("a stored variant names its model by a string and its tools by a list of names")
        try:
            tuning = data.get("tuning")
            if tuning is not None:
                checkpoint = tuning.get("checkpoint")
                if isinstance(checkpoint, dict):
                    tuning = {**tuning, "checkpoint": CheckpointConfig(**checkpoint)}
                # A variant stored before Tuning's compact_* fields were renamed: its fields, named as now.
                tuning = Tuning(**{RENAMED_FIELDS.get(k, k): v for k, v in tuning.items()})
            return cls(prompt=data.get("prompt"), model=data.get("model"), instructions=data.get("instructions"),
                       tools=data.get("tools"), tuning=tuning,
                       edits=tuple(Edit.from_json(e) for e in data.get("edits") or ()))
        except VariantError:
            raise
        except (AttributeError, TypeError, ValueError) as e:
            raise VariantError(f"a stored variant cannot be read: {e}") from e

    def describe(self) -> str:
        """What the variant changes, in one line (``loomray tree`` and ``show`` print it)."""
        return describe_variant(self.to_json())


def describe_variant(stored: dict[str, Any]) -> str:
    """A stored variant (:meth:`Variant.to_json`) in one line: each field it sets, shortened."""
    parts = []
    for key in ("model", "instructions", "prompt"):
        if key in stored:
            text = str(stored[key])
            parts.append(f"{key}={text if len(text) <= 40 else text[:39] + '…'!r}" if key != "model"
                         else f"model={text}")
    if "tools" in stored:
        parts.append("tools=[" + ", ".join(stored["tools"]) + "]")
    if "tuning" in stored:
        default = dataclasses.asdict(Tuning())
        changed = {k: v for k, v in stored["tuning"].items() if default.get(k) != v}
        parts.append("tuning(" + ", ".join(f"{k}={v}" for k, v in changed.items()) + ")")
    if stored.get("edits"):
        parts.append("edits: " + ", ".join(Edit.from_json(e).describe() for e in stored["edits"]))
    return "; ".join(parts) or "no change"


def fork_arms(prompts: Any, variants: Any) -> list[tuple[str | None, dict[str, Any] | None]]:
    """``(prompt, stored variant)`` of each fork ``Agent.fork`` was asked for; exactly one of the two lists
    (``TypeError`` otherwise)."""
    if (prompts is None) == (variants is None):
        raise TypeError("fork() takes exactly one of prompts=[...] or variants=[...]")
    given = prompts if variants is None else variants
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise TypeError(f"{'prompts' if variants is None else 'variants'} must be a list, not {type(given).__name__}")
    if variants is None:
        return [(p, None) for p in prompts]
    wrong = [type(v).__name__ for v in variants if not isinstance(v, Variant)]
    if wrong:
        raise TypeError(f"variants must be loomray.Variant values, got {wrong[0]}")
    return [(v.prompt, v.to_json()) for v in variants]


def apply_edits(messages: Sequence[Message], edits: Sequence[Edit]) -> list[Message]:
    """``messages`` with ``edits`` applied in order, as a new list (:class:`VariantError` for an index outside)."""
    out = list(messages)
    for n, edit in enumerate(edits):
        i = _edit_index(n, edit, len(out))
        if edit.op == "drop":
            del out[i]
        elif edit.op == "replace":
            assert edit.message is not None
            out[i] = edit.message
        else:
            assert edit.message is not None
            out.insert(i, edit.message)
    return out


def check_edits(message_count: int, edits: Sequence[Edit]) -> None:
    """:class:`VariantError` unless ``edits`` apply to a transcript of ``message_count`` messages (as
    :func:`apply_edits` would find): a fork checks its variants against the checkpoint's index row, unread."""
    for n, edit in enumerate(edits):
        _edit_index(n, edit, message_count)
        message_count += {"drop": -1, "replace": 0, "insert": 1}[edit.op]


def _edit_index(n: int, edit: Edit, length: int) -> int:
    """Where edit ``n`` applies in a transcript of ``length`` messages (:class:`VariantError` if outside it)."""
    # As Python's lists count: insert takes -len..len (len appends), replace and drop -len..len-1.
    top = length + 1 if edit.op == "insert" else length
    if not -length <= edit.index < top:
        raise VariantError(f"edit {n} ({edit.describe()}) is outside a transcript of {length} message(s)")
    return edit.index if edit.index >= 0 else edit.index + length


def fork_transcript(messages: Sequence[Message], stored: dict[str, Any]) -> list[Message]:
    """The transcript a fork with variant ``stored`` starts from: the fork point's, edited, with the
    variant's instructions as its system message (replacing the first message if that is one)."""
    variant = Variant.from_json(stored)
    out = apply_edits(messages, variant.edits)
    if variant.instructions is not None:
        system = Message(role="system", content=variant.instructions)
        out = [system, *out[1:]] if out and out[0].role == "system" else [system, *out]
    return out


class VariantBase(Protocol):
    """What a variant changes on an agent, and where it records which variant it is (an Agent has all of it)."""

    model: Model
    instructions: str
    tools: dict[str, Tool]
    tuning: Tuning
    variant: dict[str, Any] | None


A = TypeVar("A", bound=VariantBase)


def variant_agent(base: A, variant: Variant) -> A:
    """A copy of agent ``base`` with the fields ``variant`` sets, recording the stored form (:func:`agent_for`).

    A tool name ``base`` lacks, or a model name that does not resolve, raises :class:`VariantError`.
    """
    clone = object.__new__(type(base))  # not copy.copy: the Agent's pickled state leaves its runtime out
    clone.__dict__.update(base.__dict__)
    if variant.model is not None:
        same = isinstance(variant.model, str) and variant.model == base.model.name
        try:
            clone.model = base.model if same else resolve_model(variant.model)
        except (TypeError, LoomrayUserError) as e:
            raise VariantError(f"the variant's model {variant.model!r} cannot be used: {e}") from e
    if variant.instructions is not None:
        clone.instructions = variant.instructions
    if variant.tools is not None:
        clone.tools = _tools(base.tools, variant.tools)
    if variant.tuning is not None:
        variant.tuning.checkpoint_config()  # a wrong checkpoint type fails here, as in Agent()
        clone.tuning = variant.tuning
    clone.variant = variant.to_json()
    return clone


def _tools(base: dict[str, Tool], given: Sequence[Any]) -> dict[str, Tool]:
    named = [t for t in given if isinstance(t, str)]
    missing = [n for n in named if n not in base]
    if missing:
        raise VariantError(f"the variant names tool(s) {missing} the base agent does not have: {sorted(base)}")
    try:
        return as_tools([base[t] if isinstance(t, str) else t for t in given])
    except (TypeError, ValueError) as e:
        raise VariantError(f"the variant's tools cannot be used: {e}") from e


def agent_for(agent: A, stored: dict[str, Any] | None) -> A:
    """The agent a run carrying variant ``stored`` runs with: ``agent`` when it is that variant's already (or
    there is none), else the variant rebuilt against ``agent``, the base."""
    held = getattr(agent, "variant", None)  # an agent pickled before variants existed has none
    if stored is None or held == stored:
        return agent
    if held is not None:
        raise VariantError(f"this run's stored variant ({describe_variant(stored)}) is not the one its agent was "
                           f"built with ({describe_variant(held)})")
    return variant_agent(agent, Variant.from_json(stored))
