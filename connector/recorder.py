"""Transfer samples and events, accumulated between two engine steps (no vLLM types)."""

from __future__ import annotations

import threading

# Per-transfer samples (one entry per transfer) and event counters (one entry per event).
SAMPLES = (
    "push_seconds",
    "push_bytes",
    "push_blocks",
    "push_segments",
    "pull_seconds",
    "pull_bytes",
)
EVENTS = (
    "push_failures",
    "pull_failures",
    "expired",
    "refused",
    "digest_mismatches",
    "bad_params",
)
# Levels (one entry: the value now), shipped only when they change, so an idle engine
# ships nothing: requests a prefiller holds for a decoder, pulls a decoder waits for.
GAUGES = (
    "held_requests",
    "waiting_pulls",
)


def empty_data() -> dict[str, list[float]]:
    return {k: [] for k in (*SAMPLES, *EVENTS, *GAUGES)}


class TransferRecorder:
    """Thread-safe accumulation between two engine steps; no vLLM types, so testable alone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty_data()

    def push(self, seconds: float, nbytes: int, blocks: int, segments: int) -> None:
        with self._lock:
            for k, v in zip(SAMPLES[:4], (seconds, nbytes, blocks, segments), strict=True):
                self._data[k].append(v)

    def pull(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._data["pull_seconds"].append(seconds)
            self._data["pull_bytes"].append(nbytes)

    def event(self, name: str, count: int = 1) -> None:
        if name not in EVENTS:
            raise KeyError(name)
        with self._lock:
            self._data[name].extend([1] * count)

    def gauge(self, name: str, value: float) -> None:
        """Set a level; the last value set before :meth:`take` is the one shipped."""
        if name not in GAUGES:
            raise KeyError(name)
        with self._lock:
            self._data[name] = [value]

    def take(self) -> dict[str, list[float]] | None:
        with self._lock:
            data, self._data = self._data, empty_data()
        return data if any(data.values()) else None
