"""Tools: plain functions (sync or async) or ``@tool``-decorated ones (docs/api.md, "Tools").

A tool's JSON schema comes from its signature and docstring through pydantic, which also validates the
model's arguments. A tool that raises does not kill the run: the model gets an error tool message.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from loomray.errors import ToolAborted
from loomray.records import Message, ToolCall


@dataclass(frozen=True)
class ToolContext:
    """What a tool may learn about the call it serves."""

    session_id: str
    user_id: str | None
    run_id: str | None
    turn: int
    tool_call_id: str
    #: The ``context=`` value passed to ``Agent.run``.
    context: Any = None
    #: The key from ``@tool(idempotency_key=...)``, for passing on to external APIs.
    idempotency_key: str | None = None


_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.+)$")


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google/numpy-ish docstring into a description and per-argument texts."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    desc: list[str] = []
    args: dict[str, str] = {}
    section = None
    current = None
    for line in lines:
        stripped = line.strip()
        if stripped.lower() in ("args:", "arguments:", "parameters:", "params:"):
            section = "args"
            continue
        if stripped.lower() in ("returns:", "raises:", "yields:", "examples:", "example:", "note:"):
            section = "other"
            continue
        if section is None:
            desc.append(line)
        elif section == "args":
            m = _ARG_LINE.match(line)
            if m and not line.startswith("        "):
                current = m.group(1).lstrip("*")
                args[current] = m.group(3).strip()
            elif current and stripped:
                args[current] += " " + stripped
    return "\n".join(desc).strip(), args


class Tool:
    """A callable the model may invoke, with its JSON schema; built by :func:`tool` or from a plain function."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        idempotency_key: Callable[[dict[str, Any]], str] | None = None,
        requires_approval: bool | Callable[[ToolCall], bool] = False,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"a tool must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or fn.__name__
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.name):
            raise ValueError(f"tool name {self.name!r} must match [A-Za-z0-9_-]{{1,64}}")
        doc_desc, arg_docs = _parse_docstring(fn.__doc__)
        self.description = description if description is not None else doc_desc
        self.idempotency_key = idempotency_key
        if not (isinstance(requires_approval, bool) or callable(requires_approval)):
            raise TypeError("requires_approval must be a bool or a callable(call) -> bool, "
                            f"got {type(requires_approval).__name__}")
        self.requires_approval = requires_approval
        self.is_async = inspect.iscoroutinefunction(fn)
        self._context_param: str | None = None
        fields: dict[str, Any] = {}
        try:
            hints = _type_hints(fn)
        except Exception:  # unresolvable forward refs: fall back to raw annotations
            hints = {}
        for pname, param in inspect.signature(fn).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            annotation = hints.get(pname, param.annotation)
            if annotation is ToolContext or (isinstance(annotation, str) and annotation.split(".")[-1] == "ToolContext"):
                self._context_param = pname
                continue
            if annotation is inspect.Parameter.empty:
                annotation = Any
            default = ... if param.default is inspect.Parameter.empty else param.default
            fields[pname] = (annotation, Field(default, description=arg_docs.get(pname)))
        self.args_model: type[BaseModel] = create_model(
            f"{self.name}_args", __config__=ConfigDict(extra="forbid"), **fields
        )

    @property
    def schema(self) -> dict[str, Any]:
        """``{"name", "description", "parameters"}`` as providers expect it."""
        params = self.args_model.model_json_schema()
        params.pop("title", None)
        for prop in params.get("properties", {}).values():
            prop.pop("title", None)
        return {"name": self.name, "description": self.description, "parameters": params}

    def key_for(self, arguments: dict[str, Any]) -> str | None:
        """The idempotency key for these arguments, or None when the tool declares none."""
        if self.idempotency_key is None:
            return None
        return str(self.idempotency_key(arguments))

    def needs_approval(self, call: ToolCall) -> bool:
        """True when ``call`` must wait for a decision. A policy that raises counts as "needs approval"
        (fail closed); a policy's answer is only asked while the call has no journaled decision."""
        policy = self.requires_approval
        if isinstance(policy, bool):
            return policy
        try:
            return bool(policy(call))
        except Exception:
            return True

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> str:
        """Validate ``arguments`` and run the tool; its result as text (``ValidationError``, or what it raises)."""
        parsed = self.args_model.model_validate(arguments)
        kwargs = {k: getattr(parsed, k) for k in type(parsed).model_fields}
        if self._context_param:
            kwargs[self._context_param] = ctx
        if self.is_async:
            result = await self.fn(**kwargs)
        else:
            # Sync tools run in a thread so a slow one does not stall emit/uploads.
            result = await asyncio.to_thread(self.fn, **kwargs)
            if inspect.isawaitable(result):
                result = await result
        return _to_text(result)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    # ToolContext is resolvable even when the tool's module imported it locally (string annotations).
    return typing.get_type_hints(fn, localns={"ToolContext": ToolContext})


def _to_text(result: Any) -> str:
    if result is None:
        return ""
    if isinstance(result, str):
        return result
    if isinstance(result, BaseModel):
        return result.model_dump_json()
    try:
        return json.dumps(result, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(result)


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    idempotency_key: Callable[[dict[str, Any]], str] | None = None,
    requires_approval: bool | Callable[[ToolCall], bool] = False,
):
    """Make a function a :class:`Tool`; usable bare (``@tool``) or with options (docs/api.md, "Tools").

    ``idempotency_key(arguments) -> str``: a call whose key was journaled in this run returns the journaled
    result. ``requires_approval`` (a bool or a policy) stops the run before such a call runs.
    """

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(f, name=name, description=description, idempotency_key=idempotency_key,
                    requires_approval=requires_approval)

    if fn is not None:
        return wrap(fn)
    return wrap


def as_tools(items: Iterable[Any]) -> dict[str, Tool]:
    """Normalize functions and Tools into a name -> Tool map; duplicate names are an error."""
    out: dict[str, Tool] = {}
    for item in items:
        t = item if isinstance(item, Tool) else Tool(item)
        if t.name in out:
            raise ValueError(f"two tools are named {t.name!r}")
        out[t.name] = t
    return out


async def run_tool_call(tools: dict[str, Tool], call: ToolCall, ctx: ToolContext) -> Message:
    """Execute one tool call; a failure becomes an error tool message, except a tool's attempt to end its
    process or thread, which ends this session's run with :class:`~loomray.errors.ToolAborted`."""
    t = tools.get(call.name)
    if t is None:
        content, is_error = f"unknown tool {call.name!r}; available: {sorted(tools)}", True
    else:
        try:
            content, is_error = await t.invoke(call.arguments, ctx), False
        except ValidationError as e:
            content, is_error = f"invalid arguments for {call.name}: {e}", True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a tool's failure is information for the model
            content, is_error = f"{type(e).__name__}: {e}", True
        except (SystemExit, KeyboardInterrupt, GeneratorExit) as e:
            # Raised on, it would end the event loop that hosts this and (dense placement) other sessions,
            # silently: the run ends here instead, with a typed error, and the process goes on.
            raise ToolAborted(f"tool {call.name!r} raised {type(e).__name__}({e}); the run of this session is "
                              "stopped (its checkpoints stay)", tool=call.name, raised=type(e).__name__) from None
    return Message(role="tool", content=content, tool_call_id=call.id, name=call.name, is_error=is_error)
