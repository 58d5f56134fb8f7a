"""Workloads: token-exact synthetic prompts (fixed, random, shared prefix, multi-turn) or a
user's JSONL file, turned into sessions of turns, plus the request bodies they become.

Prompts are built with the served model's own tokenizer and measured the way vLLM counts
them (completions: the prompt text with the tokenizer's special tokens; chat: the rendered
chat template, no extra special tokens), so ``expected_prompt_tokens`` is what the server
reports in ``usage.prompt_tokens``. All randomness comes from one seeded RNG, so the same
arguments give the same prompts on every target (that is what makes an A/B fair).
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

COMPLETIONS = "completions"
CHAT = "chat"
ENDPOINT_PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}

FIXED = "fixed"
RANDOM = "random"
SHARED_PREFIX = "shared-prefix"
MULTI_TURN = "multi-turn"
JSONL = "jsonl"
KINDS = (FIXED, RANDOM, SHARED_PREFIX, MULTI_TURN, JSONL)

_WORD = re.compile(r"^ ?[A-Za-z]{2,}$")


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer this module needs."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> Any: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def apply_chat_template(self, conversation: Any, **kw: Any) -> Any: ...
    def __len__(self) -> int: ...


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | Path) -> Tokenizer:
    """The model's tokenizer from a local directory, never from a model hub (cached: an A/B
    run loads it once for both targets)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))  # type: ignore[no-any-return]


@dataclass
class Turn:
    """One request of a session: the new user content and how many tokens to ask for."""

    user: str | list[int]
    max_tokens: int
    system: str | None = None
    # Verbatim chat messages from a user's file (then user/system are not used for chat).
    messages: list[dict[str, Any]] | None = None
    expected_prompt_tokens: int | None = None


@dataclass
class Session:
    """Turns sent one after another on one conversation; single-turn workloads have one."""

    id: int
    turns: list[Turn]
    group: int | None = None


@dataclass
class WorkloadSpec:
    """What to generate; lengths are (min, max) token ranges, equal ends for fixed sizes."""

    kind: str = RANDOM
    endpoint: str = COMPLETIONS
    input_len: tuple[int, int] = (256, 512)
    output_len: tuple[int, int] = (32, 64)
    groups: int = 4
    prefix_len: int = 256
    turns: int = 3
    dataset: Path | None = None

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["dataset"] = str(self.dataset) if self.dataset else None
        return d


def parse_range(text: str) -> tuple[int, int]:
    """'384' -> (384, 384); '256-512' or '256:512' -> (256, 512)."""
    parts = re.split(r"[-:]", text.strip())
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError as e:
        raise ValueError(f"bad length {text!r}: use N or MIN-MAX") from e
    if lo < 1 or hi < lo:
        raise ValueError(f"bad length {text!r}: need 1 <= MIN <= MAX")
    return lo, hi


@dataclass
class PromptMaker:
    """Builds text whose token count, as the server will see it, is exactly a target."""

    tok: Tokenizer
    rng: random.Random
    words: list[int] = field(default_factory=list)
    inexact: int = 0

    def __post_init__(self) -> None:
        if not self.words:
            self.words = word_tokens(self.tok)

    def completion_tokens(self, prompt: str) -> int:
        return len(self.tok(prompt, add_special_tokens=True)["input_ids"])

    def chat_tokens(self, messages: list[dict[str, Any]]) -> int:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def random_text(self, n: int) -> str:
        return self.tok.decode([self.rng.choice(self.words) for _ in range(max(0, n))])

    def fit(
        self, target: int, measure: Callable[[str], int], seed_text: str = ""
    ) -> tuple[str, int]:
        """Grow or trim random text until ``measure(text) == target``; returns (text, count).

        Byte-level BPE can merge across the edit point, so this iterates; if it cannot land
        exactly (rare), it returns the closest text and its real count, never a wrong claim.
        """
        text = seed_text or self.random_text(target - measure(""))
        best = (text, measure(text))
        for _ in range(40):
            n = measure(text)
            if abs(n - target) < abs(best[1] - target):
                best = (text, n)
            if n == target:
                return text, n
            if n < target:
                text += self.random_text(target - n)
            else:
                ids = self.tok(text, add_special_tokens=False)["input_ids"]
                text = self.tok.decode(ids[: max(0, len(ids) - (n - target))])
        self.inexact += 1
        return best

    def completion_prompt(self, target: int, prefix: str = "") -> tuple[str, int]:
        text, n = self.fit(target, lambda t: self.completion_tokens(prefix + t))
        return text, n

    def chat_user(
        self, target: int, system: str | None = None, history: Sequence[tuple[str, str]] = ()
    ) -> tuple[str, int]:
        def measure(t: str) -> int:
            return self.chat_tokens(chat_messages(system, history, t))

        return self.fit(target, measure)


def word_tokens(tok: Tokenizer) -> list[int]:
    """Token ids that decode to plain words: random text from them re-encodes predictably."""
    special = set(getattr(tok, "all_special_ids", []) or [])
    words = [
        i
        for i in range(len(tok))
        if i not in special and _WORD.match(tok.decode([i]) or "") is not None
    ]
    if len(words) < 10:  # an odd vocabulary: fall back to anything that is not special
        words = [i for i in range(len(tok)) if i not in special]
    return words


def chat_messages(
    system: str | None, history: Sequence[tuple[str, str]], user: str
) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if system:
        msgs.append({"role": "system", "content": system})
    for u, a in history:
        msgs.append({"role": "user", "content": u})
        msgs.append({"role": "assistant", "content": a})
    msgs.append({"role": "user", "content": user})
    return msgs


def build_sessions(
    spec: WorkloadSpec, num_requests: int, tok: Tokenizer, seed: int
) -> tuple[list[Session], int]:
    """Sessions holding exactly ``num_requests`` turns, and how many prompts were inexact."""
    rng = random.Random(seed)
    pm = PromptMaker(tok, rng)
    if spec.kind == JSONL:
        if spec.dataset is None:
            raise ValueError("the jsonl workload needs --dataset FILE")
        return jsonl_sessions(spec, num_requests, pm), 0

    def out_len() -> int:
        return rng.randint(*spec.output_len)

    def in_len() -> int:
        return rng.randint(*spec.input_len)

    sessions: list[Session] = []
    if spec.kind in (FIXED, RANDOM):
        for i in range(num_requests):
            sessions.append(Session(i, [single_turn(pm, spec.endpoint, in_len(), out_len())]))
    elif spec.kind == SHARED_PREFIX:
        prefixes = [shared_prefix(pm, spec.endpoint, spec.prefix_len) for _ in range(spec.groups)]
        for i in range(num_requests):
            g = i % spec.groups  # interleaved: consecutive requests hit different groups
            sessions.append(
                Session(i, [single_turn(pm, spec.endpoint, in_len(), out_len(), prefixes[g])], g)
            )
    elif spec.kind == MULTI_TURN:
        n_sessions = math.ceil(num_requests / spec.turns)
        left = num_requests
        for i in range(n_sessions):
            k = min(spec.turns, left)
            left -= k
            # Later turns' prompts include earlier answers, known only at run time; the
            # first turn is exact, the rest are measured by the server's usage.
            turns = [single_turn(pm, spec.endpoint, in_len(), out_len())]
            for _ in range(k - 1):
                turns.append(Turn(user=pm.random_text(in_len()), max_tokens=out_len()))
            sessions.append(Session(i, turns))
    else:
        raise ValueError(f"unknown workload {spec.kind!r}; choose from {', '.join(KINDS)}")
    return sessions, pm.inexact


def shared_prefix(pm: PromptMaker, endpoint: str, n: int) -> str:
    """A long "system prompt" of exactly n tokens (as a chat system message or a text head)."""
    if endpoint == CHAT:
        base = pm.chat_tokens([{"role": "system", "content": ""}])
        return pm.fit(n + base, lambda t: pm.chat_tokens([{"role": "system", "content": t}]))[0]
    return pm.completion_prompt(n)[0]


def single_turn(
    pm: PromptMaker, endpoint: str, n_in: int, n_out: int, system: str | None = None
) -> Turn:
    """A turn whose whole prompt (system/prefix included) is n_in (+ prefix) tokens."""
    if endpoint == CHAT:
        # Without a system prompt n_in is the whole templated prompt; with one, n_in tokens
        # come on top of the system part (template overhead of an empty user turn included).
        floor = pm.chat_tokens(chat_messages(system, (), ""))
        target = floor + n_in if system else n_in
        text, n = pm.chat_user(max(target, floor + 1), system)
        return Turn(user=text, max_tokens=n_out, system=system, expected_prompt_tokens=n)
    prefix = system or ""
    target = n_in + (pm.completion_tokens(prefix) if prefix else 0)
    text, n = pm.completion_prompt(target, prefix)
    return Turn(user=text, max_tokens=n_out, system=system, expected_prompt_tokens=n)


def jsonl_sessions(spec: WorkloadSpec, num_requests: int, pm: PromptMaker) -> list[Session]:
    """One session per line: ``prompt`` (text or token ids) or ``messages``, optional
    ``max_tokens``/``output_len``; lines are reused in order when there are too few."""
    assert spec.dataset is not None
    rows: list[dict[str, Any]] = []
    with Path(spec.dataset).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{spec.dataset}:{lineno}: not JSON ({e})") from e
            if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
                raise ValueError(f"{spec.dataset}:{lineno}: need 'prompt' or 'messages'")
            rows.append(row)
    if not rows:
        raise ValueError(f"{spec.dataset}: no prompts")
    sessions = []
    for i in range(num_requests):
        row = rows[i % len(rows)]
        n_out = int(
            row.get("max_tokens") or row.get("output_len") or pm.rng.randint(*spec.output_len)
        )
        msgs = row.get("messages")
        prompt = row.get("prompt")
        if spec.endpoint == CHAT:
            if msgs is None:
                if not isinstance(prompt, str):
                    raise ValueError(f"{spec.dataset}: a chat prompt must be text")
                msgs = [{"role": "user", "content": prompt}]
            turn = Turn(user="", max_tokens=n_out, messages=msgs)
            turn.expected_prompt_tokens = pm.chat_tokens(msgs)
        else:
            if prompt is None:
                prompt = pm.tok.apply_chat_template(
                    msgs, tokenize=False, add_generation_prompt=True
                )
            turn = Turn(user=prompt, max_tokens=n_out)
            turn.expected_prompt_tokens = (
                len(prompt) if isinstance(prompt, list) else pm.completion_tokens(prompt)
            )
        sessions.append(Session(i, [turn]))
    return sessions


@dataclass(frozen=True)
class Sampling:
    """Request fields shared by every request of a run."""

    model: str
    stream: bool = True
    temperature: float | None = 0.0
    ignore_eos: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def build_body(
    endpoint: str, turn: Turn, history: Sequence[tuple[str, str]], s: Sampling
) -> dict[str, Any]:
    """The JSON body for one turn, given the conversation so far (user, answer) pairs."""
    body: dict[str, Any] = {"model": s.model}
    if endpoint == CHAT:
        assert isinstance(turn.user, str)
        body["messages"] = turn.messages or chat_messages(turn.system, history, turn.user)
        body["max_completion_tokens"] = turn.max_tokens
    else:
        if isinstance(turn.user, list):
            body["prompt"] = turn.user
        else:
            head = (turn.system or "") + "".join(u + a for u, a in history)
            body["prompt"] = head + turn.user
        body["max_tokens"] = turn.max_tokens
    if s.temperature is not None:
        body["temperature"] = s.temperature
    if s.ignore_eos:
        body["ignore_eos"] = True
    body["stream"] = s.stream
    if s.stream:
        body["stream_options"] = {"include_usage": True}
    body.update(s.extra)
    return body
