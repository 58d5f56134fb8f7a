"""Pure SSE decoding and per-request token timing from timestamped chunks.

Kept free of I/O so the timing rules (the same as vLLM's benchmark client: a chunk counts
as a token chunk when it carries ``choices``, the usage-only chunk does not) are unit-tested.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from typing import Any

DONE = "[DONE]"


class SseDecoder:
    """Incremental server-sent-events parser: bytes in, each complete event's data out."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += self._utf8.decode(chunk)
        out: list[str] = []
        while True:
            nl = self._buf.find("\n")
            if nl < 0:
                return out
            line = self._buf[:nl].rstrip("\r")
            self._buf = self._buf[nl + 1 :]
            self._line(line, out)

    def flush(self) -> list[str]:
        """End of body: a last event without its blank line still counts (as in vLLM)."""
        out: list[str] = []
        self._buf += self._utf8.decode(b"", final=True)
        if self._buf:
            self._line(self._buf.rstrip("\r"), out)
            self._buf = ""
        self._line("", out)
        return out

    def _line(self, line: str, out: list[str]) -> None:
        if line == "":
            if self._data:
                out.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):  # comment / keep-alive ping
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


@dataclass
class StreamTimer:
    """Turns timestamped SSE data payloads into TTFT, ITLs, E2EL, usage and text."""

    start: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    usage: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False
    parts: list[str] = field(default_factory=list)

    def on_data(self, t: float, data: str) -> None:
        if data.strip() == DONE:
            self.done = True
            return
        try:
            msg = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"invalid JSON in stream: {data[:200]!r}"
            return
        if not isinstance(msg, dict):
            self.error = f"unexpected stream payload: {data[:200]!r}"
            return
        if msg.get("error"):
            err = msg["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        if choices := msg.get("choices"):
            if self.first_token_at is None:
                self.first_token_at = t
            else:
                assert self.last_token_at is not None
                self.itl.append(t - self.last_token_at)
            self.last_token_at = t
            self.chunks += 1
            self.parts.append(choice_text(choices[0]))
        if usage := msg.get("usage"):
            self.usage = usage

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.start

    @property
    def e2el(self) -> float | None:
        return None if self.last_token_at is None else self.last_token_at - self.start

    @property
    def text(self) -> str:
        return "".join(self.parts)


def choice_text(choice: dict[str, Any]) -> str:
    """Generated text of one choice: completions ``text`` or chat ``delta``/``message``."""
    if "text" in choice:
        return choice.get("text") or ""
    body = choice.get("delta") or choice.get("message") or {}
    return body.get("content") or ""
