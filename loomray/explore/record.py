"""An exploration as JSON objects in the store: written once each, read back whole by whoever continues it.

The layout is in docs/exploration.md ("Durable, resumable"). Every object is create-only: the first writer
wins and a second attempt reads what the first wrote, so a decision is never taken twice, whichever process
continues the exploration. Nothing here is ever pickled or imported.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from loomray.records import Message
from loomray.storage import layout
from loomray.storage.errors import PreconditionFailed
from loomray.storage.objects import ObjectStore
from loomray.variants import Edit, Variant

#: Version of the stored documents; a newer one is refused rather than misread.
RECORD_VERSION = 1


class ExplorationRecord:
    """The stored objects of one exploration (``objects`` is the runtime store's :class:`ObjectStore`)."""

    def __init__(self, objects: ObjectStore, session_id: str, user_id: str | None, exploration_id: str) -> None:
        self.objects = objects
        self.session_id, self.user_id, self.exploration_id = session_id, user_id, exploration_id
        self.prefix = layout.exploration_prefix(session_id, user_id, exploration_id)

    def put(self, name: str, doc: dict[str, Any]) -> dict[str, Any]:
        """Write ``name`` once; when it exists already, the stored document (the decision already taken)."""
        body = json.dumps({"v": RECORD_VERSION, **doc}, separators=(",", ":"), sort_keys=True).encode()
        try:
            self.objects.put(key=f"{self.prefix}{name}.json", data=body, if_none_match=True)
        except PreconditionFailed:
            existing = self.get(name)
            if existing is None:  # deleted between the two calls: nothing else wrote it, so try once more
                return self.put(name, doc)
            return existing
        return json.loads(body)

    def get(self, name: str) -> dict[str, Any] | None:
        """One stored document, or None."""
        got = self.objects.get(key=f"{self.prefix}{name}.json")
        return None if got is None else _parse(got.data, self.objects.describe(f"{self.prefix}{name}.json"))

    def load(self) -> dict[str, dict[str, Any]]:
        """Every stored document by name (one LIST, then one GET each)."""
        docs = {}
        for info in self.objects.list(prefix=self.prefix):
            if not info.key.endswith(".json"):
                continue
            got = self.objects.get(key=info.key)
            if got is not None:
                docs[info.key[len(self.prefix):-len(".json")]] = _parse(got.data, self.objects.describe(info.key))
        return docs

    def point(self) -> None:
        """Record which session this exploration belongs to, so its id alone finds it (create-only)."""
        body = json.dumps({"v": RECORD_VERSION, "session_id": self.session_id, "user_id": self.user_id}).encode()
        try:
            self.objects.put(key=layout.exploration_pointer_key(self.user_id, self.exploration_id), data=body,
                             if_none_match=True)
        except PreconditionFailed:
            pass


def find_exploration(objects: ObjectStore, exploration_id: str, user_id: str | None) -> str | None:
    """The session exploration ``exploration_id`` of ``user_id`` explores from, or None when there is none."""
    key = layout.exploration_pointer_key(user_id, exploration_id)
    got = objects.get(key=key)
    if got is None:
        return None
    session_id = _parse(got.data, objects.describe(key)).get("session_id")
    if not isinstance(session_id, str):
        raise ValueError(f"{objects.describe(key)}: no session_id")
    return session_id


def _parse(data: bytes, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise ValueError(f"{where}: not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: not a JSON object")
    if doc.get("v", 0) > RECORD_VERSION:
        raise ValueError(f"{where}: exploration record version {doc.get('v')} is newer than this release reads")
    return doc


# -- variants as JSON ----------------------------------------------------------------
def variant_doc(variant: Variant) -> dict[str, Any]:
    """What a variant is, as JSON: models and tools by name, tuning field by field (never the live objects)."""
    model = variant.model if variant.model is None or isinstance(variant.model, str) else getattr(
        variant.model, "name", type(variant.model).__name__)
    tools = None if variant.tools is None else sorted(_tool_name(t) for t in variant.tools)
    tuning = None
    if variant.tuning is not None:
        tuning = json.loads(json.dumps(dataclasses.asdict(variant.tuning), default=repr, sort_keys=True))
    edits = [{"op": e.op, "index": e.index,
              "message": None if e.message is None else e.message.model_dump(mode="json")} for e in variant.edits]
    return {"prompt": variant.prompt, "model": model, "instructions": variant.instructions, "tools": tools,
            "tuning": tuning, "edits": edits}


def variant_from_doc(doc: dict[str, Any]) -> Variant:
    """The variant a stored document describes, as far as names allow: prompt, instructions, edits, the model
    and the tools by name, and the tuning field by field.

    A model or tool object is stored by its name only: to continue with one
    that no name resolves to, the caller passes the variant again.
    """
    edits = tuple(Edit(e["op"], e["index"], None if e["message"] is None else Message.model_validate(e["message"]))
                  for e in doc.get("edits") or [])
    tuning = None if doc.get("tuning") is None else Variant.from_json({"tuning": doc["tuning"]}).tuning
    return Variant(prompt=doc.get("prompt"), model=doc.get("model"), instructions=doc.get("instructions"),
                   tools=doc.get("tools"), tuning=tuning, edits=edits)


def _tool_name(tool: Any) -> str:
    if isinstance(tool, str):  # a name of one of the base agent's tools
        return tool
    return str(getattr(tool, "name", None) or getattr(tool, "__name__", None) or type(tool).__name__)


def callable_ref(fn: Any) -> str | None:
    """``module:qualname`` of a function or class instance (what a plan compares on resume); None for None."""
    if fn is None:
        return None
    describe = getattr(fn, "describe", None)
    if callable(describe) and not isinstance(fn, type):
        return str(describe())
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"
