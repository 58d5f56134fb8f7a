"""Watches the lab while the soak runs: metrics of the proxy and every instance (signals
of faults, KV flow), and RSS of every process by PID. Every scrape has a short timeout."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import psutil

from scripts.chaos.lab import SoakLab
from scripts.chaos.promtext import instance_levels, proxy_changes, proxy_state

Record = dict[str, Any]


def tree_rss_mib(pid: int) -> float | None:
    """RSS of a process and its descendants (an engine core, a parse worker), MiB."""
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for q in procs:
        with contextlib.suppress(psutil.Error):
            total += q.memory_info().rss
    return total / 2**20


class Monitor:
    def __init__(
        self,
        lab: SoakLab,
        clock: Callable[[], float],
        sink: Callable[[Record], None],
        interval_s: float = 1.0,
        rss_every: int = 5,
        rss_warmup_s: float = 60.0,
    ) -> None:
        self.lab = lab
        self.clock = clock
        self.sink = sink
        self.interval_s = interval_s
        self.rss_every = rss_every
        self.rss_warmup_s = rss_warmup_s
        self.levels: dict[str, dict[str, float]] = {}
        self.proxy: dict[str, Any] | None = None
        self.rss: dict[str, list[tuple[float, float]]] = {}
        self.signals: list[Record] = []
        self._pulled: dict[str, float] = {}
        self._fail: dict[str, float] = {}

    def signal(self, kind: str, what: str) -> None:
        rec = {"type": "signal", "t": round(self.clock(), 4), "kind": kind, "what": what}
        self.signals.append(rec)
        self.sink(rec)

    async def scrape(self, session: aiohttp.ClientSession, url: str) -> str | None:
        try:
            async with asyncio.timeout(2.0), session.get(url + "/metrics") as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def once(self, session: aiohttp.ClientSession, tick: int) -> None:
        urls = [i.url for i in self.lab.instances] + [self.lab.proxy_url]
        pages = await asyncio.gather(*(self.scrape(session, u) for u in urls))
        for inst, page in zip(self.lab.instances, pages[:-1], strict=True):
            if page is None:
                continue
            lv = instance_levels(page)
            self.levels[inst.name] = lv
            key = f"{inst.name}#{inst.incarnation}"
            if lv["pulled_bytes"] > self._pulled.get(key, lv["pulled_bytes"]):
                self.signal("kv_flow", f"{inst.name} pulled")
            self._pulled[key] = lv["pulled_bytes"]
            fails = lv["push_failures"] + lv["pull_failures"] + lv["expired"]
            if fails > self._fail.get(key, fails):
                self.signal("kv_failure", f"{inst.name} push/pull failures or expiries")
            self._fail[key] = fails
        if pages[-1] is not None:
            st = proxy_state(pages[-1])
            for change in proxy_changes(self.proxy, st):
                self.signal("proxy", change)
            self.proxy = st
        if tick % self.rss_every == 0:
            t = round(self.clock(), 3)
            procs = [(i.name, i.child) for i in self.lab.instances] + [("proxy", self.lab.proxy)]
            for name, ch in procs:
                if ch.proc is None or not ch.alive():
                    continue
                if time.monotonic() - ch.started_at < self.rss_warmup_s:
                    continue  # a process still warming up (first requests, allocator) grows
                mib = tree_rss_mib(ch.pid)
                if mib is not None:
                    self.rss.setdefault(f"{name} pid {ch.pid}", []).append((t, mib))
                    self.sink({"type": "rss", "t": t, "proc": name, "pid": ch.pid, "mib": mib})

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            tick = 0
            while not stop.is_set():
                await self.once(session, tick)
                tick += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)

    async def final_levels(self, timeout_s: float) -> dict[str, dict[str, float]]:
        """Poll until every live instance is idle (all levels 0) or ``timeout_s``."""
        keys = ("kv_usage", "running", "waiting", "held_requests", "waiting_pulls")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        out: dict[str, dict[str, float]] = {}
        async with aiohttp.ClientSession() as session:
            while True:
                out = {}
                for inst in self.lab.instances:
                    if not inst.child.alive():  # an instance that should be up is not
                        out[inst.name] = {}
                        continue
                    page = await self.scrape(session, inst.url)
                    out[inst.name] = instance_levels(page) if page else {}
                idle = all(m and all(m[k] == 0 for k in keys) for m in out.values())
                if idle or loop.time() > deadline:
                    return {n: {k: m[k] for k in keys} if m else {} for n, m in out.items()}
                await asyncio.sleep(1.0)
