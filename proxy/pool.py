"""Which instance serves the next leg. Round robin for now; policies come later."""

from __future__ import annotations

import itertools
from collections.abc import Sequence


class RoundRobin:
    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("no instances")
        self.urls = tuple(urls)
        self._cycle = itertools.cycle(self.urls)

    def next(self) -> str:
        return next(self._cycle)
