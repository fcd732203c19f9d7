"""Helpers for the relays' tests: an engine's chat completion deltas as the proxy hands
them over, and a response that keeps what is written to it."""

from __future__ import annotations

from typing import Any

import msgspec


class Sink:
    """Stands for the client's streamed response: keeps every byte written."""

    def __init__(self) -> None:
        self.data = b""

    async def write(self, data: bytes) -> None:
        self.data += data


def delta(fields: dict[str, Any], finish: str | None = None) -> tuple[bytes, None]:
    """One engine event of one choice (the proxy's ``(payload, decoded)`` pair)."""
    choice = {"index": 0, "delta": fields, "finish_reason": finish}
    return msgspec.json.encode({"choices": [choice]}), None


# A text, then two tool calls (the first's arguments in pieces), then the finish.
TOOL_TURN = [
    delta({"role": "assistant", "content": "Checking."}),
    delta({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                           "function": {"name": "weather", "arguments": '{"city":'}}]}),
    delta({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
    delta({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                           "function": {"name": "time", "arguments": "{}"}}]}),
    delta({}, finish="tool_calls"),
]  # fmt: skip
