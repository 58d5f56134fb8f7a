"""Pure request material for the soak: a seeded pool of greedy cases, poison bodies, and
the rules that classify how a request ended.

Every load request is one of a fixed pool of (prompt, max_tokens) cases, so each has one
colocated greedy answer, computed before any fault; an answer that completed must equal it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from scripts.loadgen.sse import DONE

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
WORDS = [
    "block",
    "cache",
    "decode",
    "prefill",
    "token",
    "stream",
    "proxy",
    "engine",
    "transfer",
    "layer",
    "memory",
    "request",
    "answer",
    "window",
    "signal",
    "socket",
    "partition",
    "freeze",
    "restart",
    "expiry",
    "batch",
    "pull",
    "push",
]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict[str, Any]  # without "model" and "stream"

    def request(self, model: str, stream: bool) -> dict[str, Any]:
        body = {"model": model, **self.body, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


def make_cases(
    seed: int,
    vocab: int,
    n: int = 24,
    prompt_tokens: tuple[int, int] = (4, 600),
    max_tokens: tuple[int, int] = (4, 48),
) -> list[Case]:
    """Half completions on token-id prompts, half chat on word salad; greedy, token ids back."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        mt = rng.randint(*max_tokens)
        common = {"max_tokens": mt, "temperature": 0, "return_token_ids": True}
        if i % 2 == 0:
            length = rng.randint(*prompt_tokens)
            ids = [rng.randrange(3, vocab) for _ in range(length)]
            out.append(Case(f"cmpl{i:02d}-p{length}-o{mt}", COMPLETIONS, {"prompt": ids, **common}))
        else:
            words = rng.randint(1, max(1, prompt_tokens[1] // 4))
            text = " ".join(rng.choice(WORDS) for _ in range(words))
            msgs = [{"role": "user", "content": text}]
            out.append(Case(f"chat{i:02d}-w{words}-o{mt}", CHAT, {"messages": msgs, **common}))
    return out


def long_case(vocab: int, prompt_tokens: int, max_tokens: int, seed: int = 7) -> Case:
    """A completion whose prefill and decode take long enough to hang up inside them."""
    rng = random.Random(seed)
    ids = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
    return Case(
        f"long-p{prompt_tokens}-o{max_tokens}",
        COMPLETIONS,
        {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )


def poison_400(vocab: int, variant: int) -> tuple[str, dict[str, Any]]:
    """Requests vLLM refuses with a 400: past the context length (the prefill leg, capped
    to one token, passes; the decoder refuses), or a negative temperature (the prefiller
    refuses)."""
    ids = list(range(3, 3 + 16))
    if variant % 2 == 0:
        return "max_tokens_past_context", {
            "prompt": ids,
            "max_tokens": 100_000,
            "temperature": 0,
        }
    return "negative_temperature", {"prompt": ids, "max_tokens": 4, "temperature": -1.0}


def error_message(body: Any) -> str | None:
    """The message of an OpenAI-style error object, or None if ``body`` is not one."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        msg = body["error"].get("message")
        if isinstance(msg, str):
            return msg
    return None


def classify_json(status: int, text: str) -> tuple[str, str, dict[str, Any] | None]:
    """(outcome, error, parsed body) of a non-streamed answer: ``ok`` (200 with a
    finished choice), ``error`` (a clean OpenAI error), ``broken`` (anything else)."""
    try:
        body = json.loads(text)
    except ValueError:
        return "broken", f"HTTP {status}, not JSON: {text[:120]!r}", None
    if status == 200:
        choices = body.get("choices") if isinstance(body, dict) else None
        if choices and choices[0].get("finish_reason"):
            return "ok", "", body
        return "broken", f"200 without a finished choice: {text[:120]!r}", body
    msg = error_message(body)
    if msg is not None:
        return "error", f"HTTP {status}: {msg[:200]}", body
    return "broken", f"HTTP {status}, not an OpenAI error: {text[:120]!r}", body


@dataclass
class StreamResult:
    """What a relayed SSE stream said, event by event."""

    done: bool = False
    finished: bool = False
    error: str | None = None
    ids: list[int] | None = None
    text: str = ""
    chunks: int = 0
    bad: str | None = None

    def feed(self, data: str) -> None:
        if data.strip() == DONE:
            self.done = True
            return
        try:
            msg = json.loads(data)
        except ValueError:
            self.bad = f"invalid JSON event: {data[:120]!r}"
            return
        if not isinstance(msg, dict):
            self.bad = f"unexpected event: {data[:120]!r}"
            return
        msg_err = error_message(msg)
        if msg_err is not None or "error" in msg:
            self.error = msg_err or str(msg.get("error"))[:200]
            if msg_err is None:
                self.bad = f"error event not in OpenAI form: {data[:120]!r}"
            return
        for ch in msg.get("choices") or []:
            self.chunks += 1
            if ch.get("token_ids"):
                self.ids = (self.ids or []) + list(ch["token_ids"])
            if ch.get("finish_reason"):
                self.finished = True
            delta = ch.get("delta") or {}
            self.text += ch.get("text") or delta.get("content") or ""

    def outcome(self) -> tuple[str, str]:
        if self.bad:
            return "broken", self.bad
        if self.error is not None:
            # A clean mid-stream failure: an OpenAI error event, then [DONE].
            return ("error" if self.done else "broken"), f"stream error: {self.error}"
        if self.done and self.finished:
            return "ok", ""
        return "broken", f"stream ended early (done={self.done}, finished={self.finished})"


def answer_ids(body: dict[str, Any]) -> list[int] | None:
    ch = (body.get("choices") or [{}])[0]
    ids = ch.get("token_ids")
    return list(ids) if ids else None


def answer_text(body: dict[str, Any]) -> str:
    ch = (body.get("choices") or [{}])[0]
    if "text" in ch:
        return ch.get("text") or ""
    return (ch.get("message") or {}).get("content") or ""
