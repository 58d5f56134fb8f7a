"""The soak's client: bounded Poisson load at a concurrency cap, every request with a
deadline, each ending recorded (complete answer, clean error, broken, hang, hung up)."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from scripts.chaos.cases import (
    Case,
    StreamResult,
    answer_ids,
    answer_text,
    classify_json,
)
from scripts.loadgen.sse import SseDecoder

Record = dict[str, Any]


@dataclass
class Hangup:
    """Hang up after ``after_s`` seconds, or after ``after_chunks`` stream events."""

    after_s: float | None = None
    after_chunks: int | None = None


@dataclass
class Client:
    base: str
    model: str
    clock: Callable[[], float]  # seconds since the load started
    sink: Callable[[Record], None]
    deadline_s: float = 60.0
    session: aiohttp.ClientSession | None = None
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    active_streams: int = 0  # streams that got their first event and are not over

    async def __aenter__(self) -> Client:
        conn = aiohttp.TCPConnector(limit=64, force_close=False)
        self.session = aiohttp.ClientSession(connector=conn)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    async def send(
        self,
        path: str,
        body: dict[str, Any],
        *,
        case: str,
        expected: str | None = None,
        hangup: Hangup | None = None,
        reference: tuple[list[int] | None, str] | None = None,
        tag: str = "load",
    ) -> Record:
        """One request, bounded by the deadline; the record goes to the sink and back."""
        assert self.session is not None
        rid = f"chaos-{next(self.ids)}"
        stream = bool(body.get("stream"))
        rec: Record = {
            "type": "request",
            "id": rid,
            "tag": tag,
            "case": case,
            "endpoint": path,
            "stream": stream,
            "start": round(self.clock(), 4),
            "end": None,
            "status": 0,
            "outcome": "broken",
            "error": "",
            "expected": expected,
            "match": None,
            "first_event": None,
        }
        state: dict[str, Any] = {"sr": None, "counted": False}
        try:
            async with asyncio.timeout(self.deadline_s):
                if hangup is not None and hangup.after_s is not None:
                    try:
                        async with asyncio.timeout(hangup.after_s):
                            await self._do(rid, path, body, rec, state, hangup)
                    except TimeoutError:
                        rec["outcome"], rec["error"] = "cancelled", "hung up on purpose"
                else:
                    await self._do(rid, path, body, rec, state, hangup)
        except TimeoutError:
            rec["outcome"], rec["error"] = "hang", f"no end within {self.deadline_s:g}s"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            rec["outcome"], rec["error"] = "broken", f"{type(exc).__name__}: {exc}"[:300]
        finally:
            if state["counted"]:
                self.active_streams -= 1
        rec["end"] = round(self.clock(), 4)
        if rec["outcome"] == "ok" and reference is not None:
            ref_ids, ref_text = reference
            got_ids = rec.pop("_ids", None)
            if ref_ids is not None and got_ids is not None:
                rec["match"] = got_ids == ref_ids
            else:
                rec["match"] = rec.pop("_text", "") == ref_text
            if rec["match"] is False:
                rec["got"] = got_ids
        rec.pop("_ids", None)
        rec.pop("_text", None)
        self.sink(rec)
        return rec

    async def _do(
        self,
        rid: str,
        path: str,
        body: dict[str, Any],
        rec: Record,
        state: dict[str, Any],
        hangup: Hangup | None,
    ) -> None:
        assert self.session is not None
        headers = {"X-Request-Id": rid}
        async with self.session.post(self.base + path, json=body, headers=headers) as r:
            rec["status"] = r.status
            if not body.get("stream") or r.status != 200:
                text = await r.text()
                outcome, err, parsed = classify_json(r.status, text)
                rec["outcome"], rec["error"] = outcome, err
                if outcome == "ok" and parsed is not None:
                    rec["_ids"], rec["_text"] = answer_ids(parsed), answer_text(parsed)
                return
            dec, sr = SseDecoder(), StreamResult()
            state["sr"] = sr
            async for chunk in r.content.iter_any():
                for data in dec.feed(chunk):
                    sr.feed(data)
                if sr.chunks and not state["counted"]:
                    state["counted"] = True
                    self.active_streams += 1
                    rec["first_event"] = round(self.clock(), 4)
                if hangup is not None and hangup.after_chunks and sr.chunks >= hangup.after_chunks:
                    rec["outcome"], rec["error"] = "cancelled", "hung up mid-stream on purpose"
                    return  # leaving the context closes the connection
            for data in dec.flush():
                sr.feed(data)
            rec["outcome"], rec["error"] = sr.outcome()
            if rec["outcome"] == "ok":
                rec["_ids"], rec["_text"] = sr.ids, sr.text


def poisson_gaps(rng: random.Random, rate: float) -> float:
    return rng.expovariate(rate)


async def run_load(
    client: Client,
    cases: list[Case],
    refs: dict[str, tuple[list[int] | None, str]],
    *,
    seed: int,
    duration_s: float,
    rate: float,
    concurrency: int,
    stop: asyncio.Event,
) -> int:
    """Poisson arrivals at ``rate``/s, at most ``concurrency`` in flight, until
    ``duration_s`` or ``stop``; waits (bounded by the deadline) for what is in flight."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task[Record]] = set()
    sent = 0
    end = client.clock() + duration_s
    while not stop.is_set() and client.clock() < end:
        await asyncio.sleep(poisson_gaps(rng, rate))
        if stop.is_set() or client.clock() >= end:
            break
        case = rng.choice(cases)
        stream = rng.random() < 0.5
        await sem.acquire()

        async def one(c: Case = case, s: bool = stream) -> Record:
            try:
                return await client.send(
                    c.path, c.request(client.model, s), case=c.name, reference=refs.get(c.name)
                )
            finally:
                sem.release()

        t = asyncio.create_task(one())
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        sent += 1
    if tasks:
        await asyncio.wait(tasks, timeout=client.deadline_s + 5)
    return sent


def now_fn() -> Callable[[], float]:
    t0 = time.monotonic()
    return lambda: time.monotonic() - t0
