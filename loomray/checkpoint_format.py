"""Checkpoint format 2.0: each checkpoint holds what changed since its parent; reading one puts the chain together.

A 2.0 checkpoint object holds only what changed since the checkpoint it
builds on (its *base*): the base's first ``keep`` messages stay, ``messages``
follow them, and its ``chain`` (in the index row the object carries,
:mod:`storage.envelope`) names every object it is read from, oldest first. A
pass that adds 2 KB to a 2 MB transcript writes about 2 KB, and reading any
checkpoint is one parallel fetch of its chain
(:meth:`storage.checkpoints.Checkpoints.get_chain`). When a full snapshot
starts a new chain, how forks share their parent's chain, and the 1.0 objects
that keep loading: docs/design.md, "Checkpoints: incremental objects in chains".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from loomray.errors import CheckpointException
from loomray.records import Checkpoint, Message, Usage
from loomray.session_store import SessionStore
from loomray.storage.chains import MAX_LINKS, compress, expand, extend, ref_of
from loomray.storage.errors import InvalidIdError, StorageError
from loomray.storage.tails import Snapshot

SCHEMA_VERSION_V2 = "2.0"
#: Links a chain may reach before a full snapshot starts a new one (``CheckpointConfig.full_every``).
FULL_EVERY = 500
#: A chain may hold this much more than the transcript (in message bytes) before a full snapshot replaces it.
_SLACK = 1.25
_SLACK_BYTES = 4096


@dataclass(frozen=True)
class ChainState:
    """The chain of the last checkpoint written or restored, as its session's next checkpoint builds on it."""

    #: Single refs of the chain and of the checkpoint itself, oldest first (in the writing session's view).
    refs: tuple[str, ...]
    #: The same, compressed (ranges of consecutive links): what a header names.
    entries: tuple[str, ...]
    #: Message bytes the chain's objects hold in all.
    held: int
    #: The transcript as of the last link, and each message's serialized size.
    messages: tuple[Message, ...]
    sizes: tuple[int, ...]

    def rebased(self, session_id: str, to_session_id: str) -> ChainState:
        """This chain (of session ``session_id``) as session ``to_session_id`` names it (a fork's first link)."""
        refs = tuple(ref_of(sid, cid, to_session_id) for sid, cid in expand(self.refs, session_id))
        return ChainState(refs, compress(refs), self.held, self.messages, self.sizes)


@dataclass(frozen=True)
class Encoded:
    """One checkpoint as its object's body, the chain it names, and the chain state once it is written."""

    body: bytes
    chain: tuple[str, ...]
    state: ChainState


def _serialized(messages: list[Message]) -> list[bytes]:
    return [m.__pydantic_serializer__.to_json(m) for m in messages]


def _kept(base: tuple[Message, ...], messages: list[Message]) -> int:
    """How many of ``base``'s first messages ``messages`` starts with (the same objects, or equal ones)."""
    n = min(len(base), len(messages))
    for i in range(n):
        if base[i] is not messages[i] and base[i] != messages[i]:
            return i
    return n


class ChainEncoder:
    """Turns each checkpoint into the smallest object that reads back whole: :meth:`encode` decides,
    :meth:`commit` advances once it is written, :meth:`reset` after a failed write makes the next one full."""

    def __init__(self, state: ChainState | None, *, full_every: int = FULL_EVERY) -> None:
        if not 1 <= full_every <= MAX_LINKS:
            raise ValueError(f"full_every must be in [1, {MAX_LINKS}], got {full_every!r}")
        self.state, self.full_every = state, full_every

    def encode(self, ckpt: Checkpoint) -> Encoded:
        """The object body of ``ckpt`` (a whole checkpoint, as the loop holds it) and its place in a chain."""
        state, messages = self.state, list(ckpt.messages)
        if state is not None and len(state.refs) < self.full_every:
            keep = _kept(state.messages, messages)
            parts = _serialized(messages[keep:])
            sizes = state.sizes[:keep] + tuple(len(p) for p in parts)
            held = state.held + sum(len(p) for p in parts)
            if held <= _SLACK * sum(sizes) + _SLACK_BYTES:
                return self._encoded(ckpt, state.refs, state.entries, keep, parts, sizes, held)
        parts = _serialized(messages)
        sizes = tuple(len(p) for p in parts)
        return self._encoded(ckpt, (), (), 0, parts, sizes, sum(sizes))

    @staticmethod
    def _encoded(ckpt: Checkpoint, refs: tuple[str, ...], entries: tuple[str, ...], keep: int, parts: list[bytes],
                 sizes: tuple[int, ...], held: int) -> Encoded:
        head = {"schema_version": SCHEMA_VERSION_V2, "base": refs[-1] if refs else None, "keep": keep,
                "cursor": ckpt.cursor, "cumulative_usage": ckpt.cumulative_usage.model_dump(mode="json"),
                "pending_approvals": ckpt.pending_approvals}
        body = json.dumps(head, separators=(",", ":")).encode()[:-1] + b',"messages":[' + b",".join(parts) + b"]}"
        state = ChainState((*refs, ckpt.checkpoint_id), extend(entries, ckpt.checkpoint_id), held,
                           tuple(ckpt.messages), sizes)
        return Encoded(body, entries, state)

    def commit(self, encoded: Encoded) -> None:
        """``encoded``'s object was written: the next checkpoint builds on it."""
        self.state = encoded.state

    def reset(self) -> None:
        """A write failed: the next checkpoint is a full snapshot."""
        self.state = None


def materialize(objects: list[bytes], session_id: str) -> tuple[Checkpoint, ChainState]:
    """The whole checkpoint ``objects`` (its chain's objects then its own, oldest first) read back as, and its
    chain in session ``session_id``'s view. :class:`CheckpointException` when they do not fit together, or when
    one is intact JSON of the wrong shape (a member of the wrong type, an invalid message, a malformed ref)."""
    if not objects:
        raise CheckpointException("no checkpoint object to read")
    try:
        return _materialize(objects, session_id)
    except CheckpointException:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as e:  # ValueError covers pydantic's ValidationError
        raise CheckpointException(f"malformed checkpoint object ({type(e).__name__}): {str(e)[:_DETAIL]}") from e


#: Characters of a parser's message a CheckpointException quotes (pydantic's can run long).
_DETAIL = 500


def _materialize(objects: list[bytes], session_id: str) -> tuple[Checkpoint, ChainState]:
    transcript: list[Message] = []
    sizes: tuple[int, ...] = ()
    refs: list[str] = []
    held = 0
    doc: dict[str, Any] = {}
    for raw in objects:
        doc = _parse(raw)
        header = doc.get("index")
        if header is None:  # format 1.0: a whole transcript, no chain
            old = Checkpoint.from_dict(doc)
            transcript, refs = list(old.messages), []
            sizes = tuple(len(p) for p in _serialized(transcript))
            held, ref = sum(sizes), ref_of(old.session_id, old.checkpoint_id, session_id)
        else:
            if not isinstance(header, dict):
                raise CheckpointException(f"the index header must be a JSON object, got {type(header).__name__}")
            owner = str(header.get("session_id", session_id))
            ref = ref_of(owner, str(header.get("checkpoint_id")), session_id)
            _check_base(doc.get("base"), refs[-1] if refs else None, owner, ref, session_id)
            keep, listed = doc.get("keep", 0), doc.get("messages", [])
            if type(keep) is not int or not 0 <= keep <= len(transcript) or not isinstance(listed, list):
                raise CheckpointException(f"checkpoint {ref!r}: keep {keep!r:.40} of {len(transcript)} messages, "
                                          f"messages a {type(listed).__name__}")
            new = [Message.model_validate(m) for m in listed]
            new_sizes = tuple(len(p) for p in _serialized(new))
            transcript, sizes = transcript[:keep] + new, sizes[:keep] + new_sizes
            held += sum(new_sizes)
        refs.append(ref)
    ckpt = _checkpoint(doc, transcript)
    return ckpt, ChainState(tuple(refs), compress(refs), held, tuple(transcript), sizes)


def _check_base(base: Any, expected: str | None, owner: str, ref: str, session_id: str) -> None:
    """:class:`CheckpointException` unless ``base`` (as object ``ref`` of session ``owner`` names it) is the
    previous object of the chain, ``expected`` (None: there is none)."""
    if (base is None) != (expected is None) or (
            base is not None and ref_of(*expand([str(base)], owner)[0], session_id) != expected):
        raise CheckpointException(f"checkpoint {ref!r}: its base {base!r:.200} is not the previous object of "
                                  f"its chain ({expected!r})")


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointException(f"checkpoint is not valid JSON (corrupt or truncated): {e}") from e
    if not isinstance(doc, dict):
        raise CheckpointException(f"checkpoint data must be a JSON object, got {type(doc).__name__}")
    return doc


def _checkpoint(doc: dict[str, Any], transcript: list[Message]) -> Checkpoint:
    """The whole :class:`Checkpoint` of the chain's last object ``doc``, with ``transcript``."""
    header = doc.get("index")
    if header is None:
        return Checkpoint.from_dict(doc)
    if doc.get("schema_version") != SCHEMA_VERSION_V2:
        raise CheckpointException(f"unknown checkpoint schema_version {doc.get('schema_version')!r}")
    fields = {k: header.get(k) for k in ("session_id", "checkpoint_id", "user_id", "agent_id", "turn", "position",
                                         "execution_status", "created_at", "parent_checkpoint_id", "forked_from",
                                         "epoch", "message_count")}
    try:
        ckpt = Checkpoint.model_validate({
            **{k: v for k, v in fields.items() if v is not None}, "schema_version": SCHEMA_VERSION_V2,
            "cursor": doc.get("cursor"), "pending_approvals": doc.get("pending_approvals"),
            "cumulative_usage": Usage.model_validate(doc.get("cumulative_usage") or {}), "messages": transcript})
    except ValidationError as e:
        raise CheckpointException(f"invalid checkpoint data: {e}") from e
    return ckpt.checked()


def load_checkpoint(store: SessionStore, session_id: str, checkpoint_id: str = "latest", *,
                    user_id: str | None = None, pinned_for: str | None = None,
                    snapshot: Snapshot | None = None) -> Checkpoint | None:
    """Read, put together and validate one checkpoint from ``store`` (None when it does not exist), carrying
    its chain, which a run restoring it builds on.

    Every load goes through here, so every failure to load is a :class:`CheckpointException` (a storage error
    kept as ``__cause__``); an invalid id stays the caller's ``InvalidIdError``. ``pinned_for``: the fork
    reading its fork point; ``snapshot``: a look at the session taken already (the pin's).
    """
    try:
        pinned: dict[str, Any] = {"pinned_for": pinned_for} if pinned_for is not None else {}
        if snapshot is not None:
            pinned["snapshot"] = snapshot
        objects = store.checkpoints.get_chain(session_id, checkpoint_id, user_id=user_id, **pinned)
    except InvalidIdError:
        raise
    except (StorageError, OSError) as e:
        raise CheckpointException(
            f"checkpoint {checkpoint_id!r} of session {session_id!r} (user {user_id!r}) could not be loaded: "
            f"{type(e).__name__}: {e}") from e
    if objects is None:
        return None
    try:
        ckpt, chain = materialize(objects, session_id)
    except CheckpointException as e:  # say which checkpoint: the parser only sees bytes
        raise CheckpointException(f"checkpoint {checkpoint_id!r} of session {session_id!r} (user {user_id!r}): {e}") from e
    if (ckpt.session_id, ckpt.user_id) != (session_id, user_id):  # an object copied from another session's prefix
        raise CheckpointException(f"checkpoint {checkpoint_id!r} of session {session_id!r} (user {user_id!r}) holds "
                                  f"session {ckpt.session_id!r:.140} of user {ckpt.user_id!r:.140}")
    ckpt._chain = chain
    return ckpt
