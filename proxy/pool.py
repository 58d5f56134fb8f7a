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
    """Per instance outlier detection: ejects (opens) after consecutive failures, half-opens
    after ``open_s``.

    Gateway failures (connect errors, resets, timeouts) and 5xx answers are counted apart,
    each against its own threshold: a poison request fails the same way on every instance,
    so answers deserve more patience than a refused connection. Opening needs the pool's
    consent (``may_eject``): a role never has every instance ejected.

    States: ``closed`` (all pass), ``open`` (none pass), ``half_open`` (one trial passes;
    its success closes the breaker, its failure opens it again). A trial that ends with no
    verdict (the client hung up, the proxy's own slots were full) goes back unused.
    """

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
    STATE_CODE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}
    GATEWAY, ANSWER = "gateway", "answer"

    def __init__(self, settings: BreakerSettings, clock: Clock = time.monotonic) -> None:
        self._s = settings
        self._clock = clock
        self._state = self.CLOSED
        self._counts = {self.GATEWAY: 0, self.ANSWER: 0}
        self._opened_at = 0.0
        self._trial_out = False
        self._trial_id = 0

    @property
    def state(self) -> str:
        if self._state == self.OPEN and self._clock() - self._opened_at >= self._s.open_s:
            self._state = self.HALF_OPEN
            self._trial_out = False
        return self._state

    @property
    def ejected(self) -> bool:
        return self.state != self.CLOSED

    def allows(self) -> bool:
        st = self.state
        return st == self.CLOSED or (st == self.HALF_OPEN and not self._trial_out)

    def on_pick(self) -> int | None:
        """The trial's id when this pick takes the half-open trial, else None."""
        if self.state == self.HALF_OPEN and not self._trial_out:
            self._trial_out = True
            self._trial_id += 1
            return self._trial_id
        return None

    def success(self) -> None:
        self._state, self._trial_out = self.CLOSED, False
        self._counts = {self.GATEWAY: 0, self.ANSWER: 0}

    def release_trial(self, trial: int) -> None:
        """The trial ``trial`` ended with no verdict: let another request try."""
        if self._state == self.HALF_OPEN and self._trial_out and trial == self._trial_id:
            self._trial_out = False

    def failure(self, kind: str, may_eject: Callable[[], bool] = lambda: True) -> str | None:
        """Count one failure of ``kind``: ``"ejected"`` if it opened the breaker,
        ``"refused"`` if the threshold was reached but the pool kept the instance in."""
        limit = self._s.gateway_failures if kind == self.GATEWAY else self._s.answer_failures
        self._counts[kind] += 1
        if self.state == self.HALF_OPEN:
            if limit == 0:  # this kind never ejects; the trial gave no verdict on health
                self._trial_out = False
                return None
            self._open()
            return "ejected"
        if self._state == self.OPEN or limit == 0 or self._counts[kind] < limit:
            return None
        if not may_eject():
            return "refused"
        self._open()
        return "ejected"

    def _open(self) -> None:
        self._state, self._opened_at, self._trial_out = self.OPEN, self._clock(), False
        self._counts = {self.GATEWAY: 0, self.ANSWER: 0}


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

    __slots__ = ("_pool", "_released", "_trial", "instance", "tokens")

    def __init__(self, pool: Pool, instance: Instance, tokens: int) -> None:
        self._pool, self.instance, self.tokens = pool, instance, tokens
        self._released = False
        instance.inflight += 1
        instance.inflight_tokens += tokens
        instance.served += 1
        # The half-open trial this leg carries, if any: handed back at release when the
        # leg ended with no verdict, or the instance would wait for a verdict forever.
        self._trial = instance.breaker.on_pick()
        pool._on_change(instance)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        inst = self.instance
        if self._trial is not None:
            inst.breaker.release_trial(self._trial)
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
        on_event: Callable[[str, str, str, str], None] | None = None,
    ) -> None:
        """``on_event(event, role, reason, url)``: ``ejected`` / ``ejection_refused`` (reason
        ``gateway`` or ``answer``) and ``panic`` (reason ``no_eligible``, url the pick)."""
        self.role = role
        self.policy = policy
        self._breaker = breaker or BreakerSettings()
        self._load_factor = load_factor
        self._rng = rng or random.Random()
        self._clock = clock
        self._change_cb = on_change
        self._forget_cb = on_forget
        self._event_cb = on_event
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

    def could_pick(self, exclude: Sequence[Instance] = (), panic: bool = False) -> bool:
        if panic:
            return any(not i.draining and i not in exclude for i in self._by_url.values())
        return bool(self.eligible(exclude))

    def has_members(self) -> bool:
        """Any instance that takes new legs at all (healthy or not): panic routing's floor."""
        return any(not i.draining for i in self._by_url.values())

    # -- verdicts -----------------------------------------------------------------------

    def success(self, inst: Instance) -> None:
        inst.breaker.success()

    def failure(self, inst: Instance, kind: str) -> None:
        """A leg on ``inst`` failed: ``gateway`` (no answer) or ``answer`` (a 5xx)."""
        verdict = inst.breaker.failure(kind, lambda: self._may_eject(inst))
        if verdict is not None:
            self._event("ejected" if verdict == "ejected" else "ejection_refused", kind, inst.url)

    def _may_eject(self, inst: Instance) -> bool:
        """Envoy's rule: at most ``max_ejection_percent`` of the role ejected at once (at
        least one when the share is above 0), and never the last instance that could serve."""
        members = [i for i in self._by_url.values() if not i.draining]
        pct = self._breaker.max_ejection_percent
        cap = max(1, math.floor(len(members) * pct / 100)) if pct > 0 else 0
        ejected = sum(1 for i in members if i.breaker.ejected)
        others = any(i is not inst and i.healthy and not i.breaker.ejected for i in members)
        return ejected < cap and others

    def _event(self, event: str, reason: str, url: str) -> None:
        if self._event_cb:
            self._event_cb(event, self.role, reason, url)

    # -- choosing -----------------------------------------------------------------------

    def pick(
        self,
        key: bytes | None = None,
        exclude: Sequence[Instance] = (),
        panic: bool = False,
    ) -> Instance | None:
        """The policy's choice among eligible instances; None if there is none.

        ``panic``: with no eligible instance, pick among every instance that is not
        draining, health and breaker ignored (Envoy's panic routing), rather than fail the
        request outright: health marks lag reality by up to ``rise`` check intervals (an
        instance that just came back), and a try costs little next to a certain 503.
        """
        cands = self.eligible(exclude)
        if not cands and panic:
            cands = [i for i in self._by_url.values() if not i.draining and i not in exclude]
            if cands:
                chosen = self._choose(cands, key)
                self._event("panic", "no_eligible", chosen.url)
                return chosen
        if not cands:
            return None
        return self._choose(cands, key)

    def _choose(self, cands: list[Instance], key: bytes | None) -> Instance:
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
