"""Pure arrival logic: load levels (rate or concurrency, single or swept) and send times."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

POISSON = "poisson"
CONSTANT = "constant"
RATE = "rate"
CONCURRENCY = "concurrency"


@dataclass(frozen=True)
class Level:
    """One load level: an open-loop request rate or a closed-loop concurrency."""

    kind: str
    value: float
    process: str = POISSON
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        if self.kind == CONCURRENCY:
            return f"conc={int(self.value)}"
        rate = "inf" if math.isinf(self.value) else f"{self.value:g}"
        cap = f",max_conc={self.max_concurrency}" if self.max_concurrency else ""
        return f"rate={rate}/s{cap}"

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "value": "inf" if math.isinf(self.value) else self.value,
            "process": self.process,
            "max_concurrency": self.max_concurrency,
            "label": self.label,
        }

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Level:
        v = d["value"]
        return cls(
            kind=str(d["kind"]),
            value=math.inf if v == "inf" else float(v),  # type: ignore[arg-type]
            process=str(d.get("process") or POISSON),
            max_concurrency=d.get("max_concurrency"),  # type: ignore[arg-type]
        )


def parse_numbers(text: str) -> list[float]:
    """'1,2,4' -> [1.0, 2.0, 4.0]; 'inf' allowed (send everything at once)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        v = float(part)
        if not v > 0:
            raise ValueError(f"load levels must be > 0, got {part!r}")
        out.append(v)
    if not out:
        raise ValueError(f"no load level in {text!r}")
    return out


def parse_levels(
    rate: str | None,
    concurrency: str | None,
    process: str = POISSON,
    max_concurrency: int | None = None,
) -> list[Level]:
    """Levels from the command line: a comma list is a sweep, run in the order given."""
    if (rate is None) == (concurrency is None):
        raise ValueError("give exactly one of --rate or --concurrency")
    if process not in (POISSON, CONSTANT):
        raise ValueError(f"arrival process must be {POISSON} or {CONSTANT}, got {process!r}")
    if rate is not None:
        return [Level(RATE, v, process, max_concurrency) for v in parse_numbers(rate)]
    assert concurrency is not None
    levels = []
    for v in parse_numbers(concurrency):
        if v != int(v) or math.isinf(v):
            raise ValueError(f"concurrency must be a whole number, got {v:g}")
        levels.append(Level(CONCURRENCY, v))
    return levels


def arrival_gaps(n: int, rate: float, process: str, rng: random.Random) -> list[float]:
    """Seconds to wait before each of n arrivals; the first goes at once (as in vLLM)."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if process == CONSTANT:
        return [0.0] + [1.0 / rate] * (n - 1)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]
