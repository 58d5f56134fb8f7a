"""Drive load phases against a target: arrivals, bounds, warm-up, progress and aborts.

Bounded by construction: a phase never issues more than its request budget, stops issuing
at its deadline and cancels whatever is still in flight then, and ends early (with a clear
reason) when the target fails too many requests in a row. Every network wait is timed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from scripts.loadgen.arrival import CONCURRENCY, Level, arrival_gaps
from scripts.loadgen.client import Timeouts, make_client, send
from scripts.loadgen.records import CANCELLED, RequestRecord
from scripts.loadgen.workloads import ENDPOINT_PATHS, Sampling, Session, build_body

# After the deadline, in-flight requests are cancelled; this bounds their clean-up.
_CANCEL_GRACE_S = 10.0


class TargetFailed(RuntimeError):
    """The target cannot serve this run (unreachable, or failing request after request).

    ``phases`` holds what was measured before the failure, so the caller can still save it.
    """

    def __init__(self, message: str, phases: list[PhaseResult] | None = None) -> None:
        super().__init__(message)
        self.phases: list[PhaseResult] = phases or []


@dataclass
class RunConfig:
    base_url: str
    endpoint: str
    sampling: Sampling
    num_requests: int
    duration_s: float
    warmup: int = 0
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_consecutive_failures: int = 10
    seed: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    progress: bool = True

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINT_PATHS[self.endpoint]


@dataclass
class PhaseResult:
    level: Level
    records: list[RequestRecord]
    t0_s: float
    wall_s: float
    stopped_by: str
    abort_reason: str | None = None
    warmup_ok: int = 0
    warmup_sent: int = 0


@dataclass
class _PhaseState:
    budget: int
    deadline: float
    max_failures: int
    records: list[RequestRecord] = field(default_factory=list)
    issued: int = 0
    in_a_row: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    abort_reason: str | None = None
    bar: Any = None
    n_ok: int = 0
    n_err: int = 0

    def may_issue(self) -> bool:
        return (
            not self.stop.is_set()
            and self.issued < self.budget
            and time.perf_counter() < self.deadline
        )

    def settle(self, rec: RequestRecord) -> None:
        if rec.status == CANCELLED:
            return
        if rec.ok:
            self.n_ok += 1
        else:
            self.n_err += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(ok=self.n_ok, err=self.n_err, refresh=False)
        if rec.ok:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if self.in_a_row >= self.max_failures and self.abort_reason is None:
            kinds = Counter(r.error_kind for r in self.records if r.error_kind)
            self.abort_reason = (
                f"{self.in_a_row} requests in a row failed (errors so far: {dict(kinds)}); "
                f"last: {rec.error_kind}: {rec.error}"
            )
            self.stop.set()


async def preflight(client: httpx.AsyncClient, base_url: str, timeout_s: float = 10.0) -> str:
    """The target's first model id, or TargetFailed with why it cannot be used."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = await asyncio.wait_for(client.get(url), timeout_s)
    except (TimeoutError, httpx.HTTPError) as e:
        raise TargetFailed(f"cannot reach {url}: {type(e).__name__}: {e}") from e
    if resp.status_code != 200:
        raise TargetFailed(f"{url} answered HTTP {resp.status_code}: {resp.text[:300]}")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise TargetFailed(f"{url} did not list a model: {resp.text[:300]}") from e


async def run_phase(
    client: httpx.AsyncClient,
    cfg: RunConfig,
    level: Level,
    sessions: Sequence[Session],
    *,
    budget: int,
    duration_s: float,
    seed: int,
    label: str,
    count_tokens: Callable[[str], int] | None = None,
    show_progress: bool = True,
) -> PhaseResult:
    """One load level until its budget is used, its deadline passes, or the target fails."""
    t0 = time.perf_counter()
    st = _PhaseState(budget, t0 + duration_s, cfg.max_consecutive_failures)
    tasks: set[asyncio.Task[None]] = set()

    async def one_session(sess: Session) -> None:
        history: list[tuple[str, str]] = []
        for k, turn in enumerate(sess.turns):
            if not st.may_issue():
                return
            st.issued += 1
            rec = RequestRecord(
                index=len(st.records),
                session=sess.id,
                turn=k,
                group=sess.group,
                expected_prompt_tokens=turn.expected_prompt_tokens,
                requested_output_tokens=turn.max_tokens,
            )
            st.records.append(rec)
            body = build_body(cfg.endpoint, turn, history, cfg.sampling)
            try:
                await send(client, cfg.url, body, rec, t0, cfg.timeouts, count_tokens, cfg.headers)
            except asyncio.CancelledError:
                rec.status, rec.error_kind = CANCELLED, "cancelled_at_stop"
                rec.error = "still in flight when the phase stopped"
                raise
            if rec.prompt_tokens is None:
                rec.prompt_tokens = rec.expected_prompt_tokens
            st.settle(rec)
            if not rec.ok:
                return  # a broken conversation does not continue
            assert isinstance(turn.user, str) or k == 0
            history.append((turn.user if isinstance(turn.user, str) else "", rec.text))

    async def limited(sess: Session, sem: asyncio.Semaphore | None) -> None:
        if sem is None:
            await one_session(sess)
            return
        async with sem:
            await one_session(sess)

    async def drive() -> None:
        if level.kind == CONCURRENCY:
            it = iter(sessions)

            async def worker() -> None:
                for sess in it:
                    if not st.may_issue():
                        return
                    await one_session(sess)

            workers = [asyncio.create_task(worker()) for _ in range(int(level.value))]
            tasks.update(workers)
            await asyncio.gather(*workers)
            return
        sem = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None
        gaps = arrival_gaps(len(sessions), level.value, level.process, random.Random(seed))
        for sess, gap in zip(sessions, gaps, strict=False):
            if gap > 0:
                wait = min(gap, max(0.0, st.deadline - time.perf_counter()))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(st.stop.wait(), wait)
            if not st.may_issue():
                break
            tasks.add(asyncio.create_task(limited(sess, sem)))
        await asyncio.gather(*list(tasks))

    bar = None
    if show_progress and cfg.progress:
        bar = tqdm(total=budget, desc=label, unit="req", mininterval=1.0, dynamic_ncols=True)
        st.bar = bar
    driver = asyncio.create_task(drive())
    stopper = asyncio.create_task(st.stop.wait())
    stopped_by = "count"
    try:
        done, _ = await asyncio.wait(
            {driver, stopper},
            timeout=max(0.0, st.deadline - time.perf_counter()),
            return_when=asyncio.FIRST_COMPLETED,
        )
        if driver not in done:
            stopped_by = "aborted" if st.stop.is_set() else "deadline"
            st.stop.set()
        elif driver.exception() is not None:
            raise driver.exception()  # type: ignore[misc]
    finally:
        st.stop.set()
        pending = [t for t in (driver, stopper, *tasks) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=_CANCEL_GRACE_S)
        if bar is not None:
            bar.close()
    if stopped_by == "count" and st.issued < budget and time.perf_counter() >= st.deadline:
        stopped_by = "deadline"
    if stopped_by == "count" and st.issued < budget and st.abort_reason is None:
        stopped_by = "sessions_exhausted"
    return PhaseResult(
        level=level,
        records=st.records,
        t0_s=0.0,
        wall_s=time.perf_counter() - t0,
        stopped_by=stopped_by if st.abort_reason is None else "aborted",
        abort_reason=st.abort_reason,
    )


async def run_levels(
    cfg: RunConfig,
    levels: Sequence[Level],
    sessions_for: Callable[[int], Sequence[Session]],
    warmup_sessions: Sequence[Session],
    count_tokens: Callable[[str], int] | None = None,
    log: Callable[[str], None] = print,
) -> list[PhaseResult]:
    """Warm up once, then each level in order; TargetFailed ends the run with its reason.

    Phases measured before a failure travel on the exception (``.phases``).
    """
    async with make_client(_pool_size(levels, cfg.num_requests), cfg.timeouts) as client:
        if cfg.sampling.model == "":
            model = await preflight(client, cfg.base_url)
            cfg.sampling = Sampling(**{**cfg.sampling.__dict__, "model": model})
            log(f"target {cfg.base_url} serves model {model!r}")
        else:
            await preflight(client, cfg.base_url)
        warm_ok = warm_sent = 0
        if cfg.warmup and warmup_sessions:
            conc = max(1, min(cfg.warmup, _concurrency_hint(levels[0])))
            log(f"warm-up: {cfg.warmup} requests at concurrency {conc} (not measured)")
            warm = await run_phase(
                client,
                cfg,
                Level(CONCURRENCY, conc),
                warmup_sessions,
                budget=cfg.warmup,
                duration_s=cfg.duration_s,
                seed=cfg.seed,
                label="warm-up",
                count_tokens=count_tokens,
                show_progress=False,
            )
            warm_sent = len(warm.records)
            warm_ok = sum(1 for r in warm.records if r.ok)
            if warm_sent and warm_ok == 0:
                first = warm.records[0]
                raise TargetFailed(
                    f"all {warm_sent} warm-up requests failed; first: "
                    f"{first.error_kind}: {first.error}"
                )
        phases: list[PhaseResult] = []
        run_t0 = time.perf_counter()  # after warm-up: plots start at the first measured send
        for i, level in enumerate(levels):
            res = await run_phase(
                client,
                cfg,
                level,
                sessions_for(i),
                budget=cfg.num_requests,
                duration_s=cfg.duration_s,
                seed=cfg.seed + 7919 * (i + 1),
                label=f"[{i + 1}/{len(levels)}] {level.label}",
                count_tokens=count_tokens,
            )
            res.t0_s = time.perf_counter() - run_t0 - res.wall_s
            res.warmup_ok, res.warmup_sent = warm_ok, warm_sent
            phases.append(res)
            ok = sum(1 for r in res.records if r.ok)
            log(
                f"{level.label}: {ok}/{len(res.records)} ok in {res.wall_s:.1f}s "
                f"(stopped by {res.stopped_by})"
            )
            if res.abort_reason:
                raise TargetFailed(f"{level.label}: {res.abort_reason}", phases)
        return phases


def _concurrency_hint(level: Level) -> int:
    if level.kind == CONCURRENCY:
        return int(level.value)
    if level.max_concurrency:
        return level.max_concurrency
    return 4 if math.isinf(level.value) else max(1, math.ceil(level.value))


def _pool_size(levels: Sequence[Level], budget: int) -> int:
    """Enough connections that the client never queues what the level means to send."""
    need = [
        budget if lv.kind != CONCURRENCY and not lv.max_concurrency else _concurrency_hint(lv)
        for lv in levels
    ]
    return max(16, *need) + 4
