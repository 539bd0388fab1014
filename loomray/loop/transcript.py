"""What the loop reads off a transcript: dangling tool calls, where their results go, denials."""

from __future__ import annotations

from loomray.records import Message, ToolCall

#: The user message that continues an unfinished run when ``resume`` gets no prompt.
CONTINUE_NUDGE = "Continue the interrupted task."


def dangling_tool_calls(messages: list[Message]) -> list[ToolCall]:
    """Tool calls of the last assistant message that have no tool result after it."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "assistant":
            if not m.tool_calls:
                return []
            answered = {x.tool_call_id for x in messages[i + 1:] if x.role == "tool"}
            return [c for c in m.tool_calls if c.id not in answered]
    return []


def tool_results_slot(messages: list[Message]) -> int:
    """Where results for the last assistant message's tool calls belong.

    Right after that message and the tool results already following it, so a
    repaired transcript (a dangling call followed by a later user message)
    keeps every result next to its call, the order provider APIs require.
    """
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "assistant":
            j = i + 1
            while j < len(messages) and messages[j].role == "tool":
                j += 1
            return j
    return len(messages)


def denial_message(call: ToolCall, reason: str | None) -> Message:
    """The error result a denied tool call returns to the model."""
    text = f"Tool call denied by the user: {reason}" if reason else "Tool call denied by the user."
    return Message(role="tool", content=text, tool_call_id=call.id, name=call.name, is_error=True)
