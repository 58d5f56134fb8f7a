"""Instances of one role, their health and load, and the policies that pick one.

Pure logic (no I/O): the request path leases an instance for a leg and releases the lease
when the leg really ends (a stream's last byte, an error, a cancellation), so in-flight
requests and prompt tokens are exact. Removing an instance drains it: it takes no new
leg, and it leaves the pool once its last lease is released.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from proxy.settings import BreakerSettings, InstanceSpec

Clock = Callable[[], float]


class CircuitBreaker:
    """Per instance: opens after N consecutive failures, half-opens after ``open_s``.

    States: ``closed`` (all pass), ``open`` (none pass), ``half_open`` (one trial passes;
    its success closes the breaker, its failure opens it again).
    """

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
    STATE_CODE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}

    def __init__(self, settings: BreakerSettings, clock: Clock = time.monotonic) -> None:
        self._s = settings
        self._clock = clock
        self._state = self.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trial_out = False

    @property
    def state(self) -> str:
        if self._state == self.OPEN and self._clock() - self._opened_at >= self._s.open_s:
            self._state = self.HALF_OPEN
            self._trial_out = False
        return self._state

    def allows(self) -> bool:
        st = self.state
        return st == self.CLOSED or (st == self.HALF_OPEN and not self._trial_out)

    def on_pick(self) -> None:
        if self.state == self.HALF_OPEN:
            self._trial_out = True

    def success(self) -> None:
        self._state, self._failures, self._trial_out = self.CLOSED, 0, False

    def release_trial(self) -> None:
        """No verdict (e.g. the proxy's own connection pool was full): a half-open trial
        goes back unused instead of blocking the instance until the next verdict."""
        if self._state == self.HALF_OPEN:
            self._trial_out = False

    def failure(self) -> None:
        self._failures += 1
        if self.state == self.HALF_OPEN or self._failures >= self._s.failures:
            self._state, self._opened_at, self._trial_out = self.OPEN, self._clock(), False


@dataclass(eq=False)
class Instance:
    spec: InstanceSpec
    role: str
    breaker: CircuitBreaker
    healthy: bool = True
    draining: bool = False
    inflight: int = 0
    inflight_tokens: int = 0
    served: int = 0
    check_failures: int = 0
    check_successes: int = 0
    last_check_error: str | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def weight(self) -> float:
        return self.spec.weight

    def eligible(self) -> bool:
        return self.healthy and not self.draining and self.breaker.allows()

    def load(self) -> tuple[float, float]:
        """Ordering key: prefill is bound by prompt tokens, decode by concurrent requests."""
        if self.role == "prefill":
            return (self.inflight_tokens / self.weight, self.inflight / self.weight)
        return (self.inflight / self.weight, self.inflight_tokens / self.weight)

    def as_dict(self) -> dict[str, object]:
        return {
            "url": self.url,
            "role": self.role,
            "weight": self.weight,
            "side_channel": self.spec.side_channel,
            "healthy": self.healthy,
            "draining": self.draining,
            "breaker": self.breaker.state,
            "inflight": self.inflight,
            "inflight_tokens": self.inflight_tokens,
            "served": self.served,
            "last_check_error": self.last_check_error,
        }


class Lease:
    """One leg on one instance; ``release()`` is idempotent."""

    __slots__ = ("_pool", "_released", "instance", "tokens")

    def __init__(self, pool: Pool, instance: Instance, tokens: int) -> None:
        self._pool, self.instance, self.tokens = pool, instance, tokens
        self._released = False
        instance.inflight += 1
        instance.inflight_tokens += tokens
        instance.served += 1
        instance.breaker.on_pick()
        pool._on_change(instance)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        inst = self.instance
        inst.inflight -= 1
        inst.inflight_tokens -= self.tokens
        self._pool._on_change(inst)
        if inst.draining and inst.inflight == 0:
            self._pool._forget(inst)


@dataclass
class _Ring:
    points: list[int] = field(default_factory=list)
    owners: list[str] = field(default_factory=list)


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Pool:
    """The instances of one role and the policy that picks among them."""

    VNODES = 64

    def __init__(
        self,
        role: str,
        specs: Iterable[InstanceSpec],
        policy: str = "round_robin",
        breaker: BreakerSettings | None = None,
        *,
        load_factor: float = 1.25,
        rng: random.Random | None = None,
        clock: Clock = time.monotonic,
        on_change: Callable[[Instance], None] | None = None,
        on_forget: Callable[[Instance], None] | None = None,
    ) -> None:
        self.role = role
        self.policy = policy
        self._breaker = breaker or BreakerSettings()
        self._load_factor = load_factor
        self._rng = rng or random.Random()
        self._clock = clock
        self._change_cb = on_change
        self._forget_cb = on_forget
        self._by_url: dict[str, Instance] = {}
        self._rr_current: dict[str, float] = {}
        self._ring = _Ring()
        for s in specs:
            self.add(s)

    # -- membership ---------------------------------------------------------------------

    @property
    def instances(self) -> list[Instance]:
        return list(self._by_url.values())

    @property
    def urls(self) -> list[str]:
        return list(self._by_url)

    def get(self, url: str) -> Instance | None:
        return self._by_url.get(url.rstrip("/"))

    def add(self, spec: InstanceSpec) -> Instance:
        """Atomic: everything that can fail (duplicate, the new ring) happens before the
        pool changes, so a refused add leaves no half-added instance behind."""
        old = self._by_url.get(spec.url)
        if old is not None and not old.draining:
            raise ValueError(f"{self.role} instance {spec.url} already exists")
        inst = Instance(spec, self.role, CircuitBreaker(self._breaker, self._clock))
        if old is not None:  # re-added while draining: keep its in-flight counts
            inst.inflight, inst.inflight_tokens = old.inflight, old.inflight_tokens
        members = {**self._by_url, spec.url: inst}
        ring = self._ring_of(members.values())
        self._by_url, self._ring = members, ring
        self._on_change(inst)
        return inst

    def remove(self, url: str) -> Instance:
        """Drain: no new legs; forgotten once its in-flight legs end (at once when idle)."""
        inst = self._by_url.get(url.rstrip("/"))
        if inst is None:
            raise KeyError(url)
        inst.draining = True
        self._rebuild_ring()
        if inst.inflight == 0:
            self._forget(inst)
        return inst

    def _forget(self, inst: Instance) -> None:
        if self._by_url.get(inst.url) is inst:
            del self._by_url[inst.url]
            self._rr_current.pop(inst.url, None)
            self._rebuild_ring()
            if self._forget_cb:
                self._forget_cb(inst)

    def _on_change(self, inst: Instance) -> None:
        if self._change_cb:
            self._change_cb(inst)

    def eligible(self, exclude: Sequence[Instance] = ()) -> list[Instance]:
        return [i for i in self._by_url.values() if i.eligible() and i not in exclude]

    def has_eligible(self) -> bool:
        return any(i.eligible() for i in self._by_url.values())

    # -- choosing -----------------------------------------------------------------------

    def pick(
        self,
        key: bytes | None = None,
        exclude: Sequence[Instance] = (),
        last_resort: bool = False,
    ) -> Instance | None:
        """The policy's choice among eligible instances; None if there is none.

        ``last_resort``: with no eligible instance, try one that failed its health checks
        (not draining, breaker permitting) rather than fail the request outright; health
        marks lag behind reality by up to one check interval (e.g. just after start-up).
        """
        cands = self.eligible(exclude)
        if not cands and last_resort:
            cands = [
                i
                for i in self._by_url.values()
                if not i.draining and i.breaker.allows() and i not in exclude
            ]
        if not cands:
            return None
        if len(cands) == 1:
            return cands[0]
        if self.policy == "round_robin":
            return self._round_robin(cands)
        if self.policy == "least_loaded":
            return min(cands, key=lambda i: (*i.load(), self._rng.random()))
        if self.policy == "power_of_two":
            a, b = self._rng.sample(cands, 2)
            return a if a.load() <= b.load() else b
        if self.policy == "prefix":
            return self._prefix(cands, key)
        raise ValueError(f"unknown policy {self.policy}")

    def lease(self, inst: Instance, tokens: int = 0) -> Lease:
        return Lease(self, inst, tokens)

    def _round_robin(self, cands: list[Instance]) -> Instance:
        """Smooth weighted round robin (as nginx): spreads picks evenly by weight."""
        total = 0.0
        best: Instance | None = None
        for i in cands:
            cur = self._rr_current.get(i.url, 0.0) + i.weight
            self._rr_current[i.url] = cur
            total += i.weight
            if best is None or cur > self._rr_current[best.url]:
                best = i
        assert best is not None
        self._rr_current[best.url] -= total
        return best

    def _rebuild_ring(self) -> None:
        self._ring = self._ring_of(self._by_url.values())

    def _ring_of(self, instances: Iterable[Instance]) -> _Ring:
        pts: list[tuple[int, str]] = []
        for inst in instances:
            if inst.draining:
                continue
            n = max(1, round(self.VNODES * inst.weight))
            pts += [(_h64(f"{inst.url}#{v}".encode()), inst.url) for v in range(n)]
        pts.sort()
        return _Ring([p for p, _ in pts], [u for _, u in pts])

    def _prefix(self, cands: list[Instance], key: bytes | None) -> Instance:
        """Consistent hashing with bounded loads: the key's owner on the ring, unless it
        already carries more than ``load_factor`` x the average (weighted) load; then the
        next instance clockwise that does not."""
        if key is None or not self._ring.points:
            return min(cands, key=lambda i: (*i.load(), self._rng.random()))
        allowed = {i.url: i for i in cands}
        total_w = sum(i.weight for i in cands)
        total = sum(i.inflight for i in cands) + 1
        start = bisect.bisect(self._ring.points, _h64(key)) % len(self._ring.points)
        seen: set[str] = set()
        first: Instance | None = None
        for k in range(len(self._ring.points)):
            url = self._ring.owners[(start + k) % len(self._ring.points)]
            if url in seen or url not in allowed:
                continue
            seen.add(url)
            inst = allowed[url]
            first = first or inst
            bound = math.ceil(self._load_factor * total * inst.weight / total_w)
            if inst.inflight + 1 <= bound:
                return inst
            if len(seen) == len(allowed):
                break
        return min(cands, key=lambda i: (*i.load(), self._rng.random())) if first else cands[0]
