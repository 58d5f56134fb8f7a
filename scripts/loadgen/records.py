"""The per-request record every other module shares (and the JSON schema of one request)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

OK = "ok"
ERROR = "error"
PENDING = "pending"  # sent, not settled yet
# Still in flight when the phase deadline (or an abort) cut it: neither a success nor a
# failure of the target, so it is counted apart and excluded from latency statistics.
CANCELLED = "cancelled"


@dataclass
class RequestRecord:
    """What one request did, with times in seconds relative to its phase start."""

    index: int
    session: int = 0
    turn: int = 0
    group: int | None = None
    start_s: float = 0.0
    status: str = PENDING
    streamed: bool = True
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    expected_prompt_tokens: int | None = None
    requested_output_tokens: int | None = None
    # "usage" when the server reported counts, "tokenizer" when we had to count the text.
    output_tokens_from: str | None = None
    http_status: int | None = None
    error_kind: str | None = None
    error: str | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def tpot_s(self) -> float | None:
        """vLLM's per-request TPOT: (e2el - ttft) / (output_tokens - 1), streamed only."""
        if (
            not self.ok
            or not self.streamed
            or self.ttft_s is None
            or self.e2el_s is None
            or not self.output_tokens
            or self.output_tokens <= 1
        ):
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float | None:
        return None if self.e2el_s is None else self.start_s + self.e2el_s

    def to_json(self, keep_text: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        if not keep_text:
            d.pop("text")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)
