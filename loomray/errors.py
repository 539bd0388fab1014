"""Every loomray exception, under one root (:class:`LoomrayError`).

``LoomrayUserError`` is a caller's mistake (bad arguments, unknown model,
missing credentials, a checkpoint that does not exist); ``LoomrayRunError`` is
a run that failed; ``CheckpointException`` is a checkpoint that could not be
read or written. All pickle cleanly so they can cross a Ray actor boundary.
"""

from __future__ import annotations

from typing import Any

from loomray.storage.errors import InvalidIdError as _StorageInvalidIdError


class LoomrayError(Exception):
    """Base of every loomray exception."""


class LoomrayUserError(LoomrayError, ValueError):
    """The caller asked for something that cannot be done (bad id, bad config, unknown model)."""


class LoomrayRunError(LoomrayError, RuntimeError):
    """A run failed while executing."""


class InvalidIdError(LoomrayUserError, _StorageInvalidIdError):
    """An id given to loomray (session, user, checkpoint, agent name) cannot be a storage key segment.

    Also a :class:`storage.errors.InvalidIdError`, so code that catches the storage error still does.
    """


class DurabilityLost(LoomrayRunError):
    """The run stopped before its next step because its lease could not be read to prove it owns its session.

    The session is recoverable from its last durable state.
    """


class CheckpointException(LoomrayError):
    """A checkpoint could not be read, validated, serialized or written."""


class CheckpointNotFound(LoomrayUserError, CheckpointException):
    """The checkpoint a resume or fork names does not exist (for this user)."""


class ModelConfigError(LoomrayUserError):
    """A model name cannot be resolved, or its SDK extra or credentials are missing."""


class ModelError(LoomrayRunError):
    """A model provider call failed (after the SDK's own retries)."""

    def __init__(self, message: str, *, provider: str | None = None, model: str | None = None,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.provider = provider
        self.model = model
        self.status = status

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_rebuild_model_error, (type(self), str(self), self.provider, self.model, self.status))


def _rebuild_model_error(cls: type[ModelError], message: str, provider: str | None, model: str | None,
                         status: int | None) -> ModelError:
    return cls(message, provider=provider, model=model, status=status)


class ModelAuthError(ModelError):
    """The provider rejected the credentials (401/403)."""


class ModelBadRequestError(ModelError):
    """The provider rejected the request as malformed (400/404/422)."""


class MaxTurnsExceeded(LoomrayRunError):
    """The loop hit ``Tuning.max_turns`` before the model stopped."""


class OutputValidationError(LoomrayRunError):
    """The model's final answer did not satisfy ``output_schema`` after the allowed retries."""


class SessionNotHosted(LoomrayRunError):
    """The host holds no activation of this session (it finished and was collected, or never came)."""


class SessionStartError(LoomrayUserError, LoomrayRunError):
    """A session could not be activated: its agent, request or store is unusable (the caller's error; for a
    restart, a run error that marks the session failed)."""


class ToolAborted(LoomrayRunError):
    """A tool tried to end its process or thread (``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``).

    The calling session's run ends with this error; every other session of the process runs on.
    """

    def __init__(self, message: str, *, tool: str | None = None, raised: str | None = None) -> None:
        super().__init__(message)
        self.tool = tool
        self.raised = raised

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_rebuild_tool_aborted, (str(self), self.tool, self.raised))


def _rebuild_tool_aborted(message: str, tool: str | None, raised: str | None) -> ToolAborted:
    return ToolAborted(message, tool=tool, raised=raised)
