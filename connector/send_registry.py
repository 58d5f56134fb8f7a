"""Prefiller-side bookkeeping of requests whose blocks are held for a decoder.

Every held request ends exactly once, by one of: sent, released (decoder needed
nothing), failed (push error: the blocks are still freed, the decoder recomputes), or
expired (no decoder came). Ended ids are reported once to vLLM through
:meth:`SendRegistry.take_finished`, which frees the blocks.

A request may be pulled in several *parts*: when the decoder's TP size differs, several
decoder ranks each pull their own KV heads from this rank (``connector.tp.cover``). The
first pull says how many parts there are; the request ends when every part has ended
(failed if any part failed), and a release ends it whole while no part is in flight.

A pull may arrive a moment before its request's blocks are handed to the worker. Such a
pull is *parked* (a callback, no thread) only if the scheduler announced the request as
expected; a pull for an id never announced is refused at once, so a peer without a
secret cannot hold anything by inventing ids. Parking is capped.
"""

from __future__ import annotations

import enum
import hmac
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from connector.logsafe import safe

# What a peer is told for an unknown, ended, busy or wrong-secret transfer: one answer,
# so a refusal does not reveal which ids are held. The prefiller's log has the detail.
UNAVAILABLE = "transfer not available"

Waiter = Callable[[bool], None]


class Outcome(enum.Enum):
    SENT = "sent"
    RELEASED = "released"
    FAILED = "failed"
    EXPIRED = "expired"
    ABORTED = "aborted"  # the prefiller finished the request without holding blocks


class ClaimError(LookupError):
    """A pull named a transfer that cannot be served; ``detail`` is for our log only."""

    def __init__(self, detail: str, public: str = UNAVAILABLE) -> None:
        super().__init__(public)
        self.detail = detail
        self.public = public


@dataclass
class _Held:
    # Per KV cache group, the prefiller's block slots (positional, 0 = not held).
    block_ids: list[list[int]]
    secret: str
    added_at: float
    parts: int = 0  # pulls that end this request; 0 until the first pull says
    claimed: int = 0
    done: int = 0
    failed: bool = False
    hold_until: float = 0.0  # after a failed engine write: free no earlier than this

    @property
    def in_flight(self) -> bool:
        return self.claimed > self.done


@dataclass
class _Parked:
    deadline: float
    waiters: list[Waiter] = field(default_factory=list)


class SendRegistry:
    def __init__(
        self,
        expiry_s: float,
        clock: Callable[[], float] = time.monotonic,
        remember_ended: int = 4096,
        max_parked: int = 1024,
        max_expected: int = 65536,
    ) -> None:
        self._expiry_s = expiry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._finished: set[str] = set()
        # Ended requests whose blocks must stay put a while longer: id -> when they may go.
        self._holding: dict[str, float] = {}
        # Recently ended ids, so a late or repeated pull gets a precise log line at once.
        self._ended: OrderedDict[str, Outcome] = OrderedDict()
        self._remember = remember_ended
        # Announced by the scheduler, not handed over yet: id -> when announced.
        self._expected: OrderedDict[str, float] = OrderedDict()
        self._max_expected = max_expected
        self._parked: dict[str, _Parked] = {}
        self._num_parked = 0
        self._max_parked = max_parked
        self.counts: dict[Outcome, int] = dict.fromkeys(Outcome, 0)
        self.refused_secret = 0
        self.duplicates = 0
        self._closed = False

    # --- fed by vLLM's worker thread ---------------------------------------------------------

    def expect(self, transfer_id: str) -> None:
        """The scheduler will hand this request over soon: a pull for it may park."""
        with self._lock:
            if transfer_id in self._held or transfer_id in self._ended:
                return
            self._expected[transfer_id] = self._clock()
            self._expected.move_to_end(transfer_id)
            while len(self._expected) > self._max_expected:
                self._expected.popitem(last=False)

    def add(self, transfer_id: str, block_ids: list[list[int]], secret: str) -> None:
        with self._lock:
            if transfer_id in self._held or transfer_id in self._ended:
                # Same id handed over twice (a reused request id): these blocks belong to a
                # request no decoder can ask for, so free them now instead of never.
                self.duplicates += 1
                self._finished.add(transfer_id)
                self.counts[Outcome.FAILED] += 1
                waiters: list[Waiter] = []
            else:
                self._expected.pop(transfer_id, None)
                self._held[transfer_id] = _Held([list(g) for g in block_ids], secret, self._clock())
                waiters = self._unpark(transfer_id)
        for wake in waiters:
            wake(True)

    def mark_aborted(self, transfer_id: str) -> None:
        """The prefiller dropped the request (e.g. aborted): nothing is held, nothing to free."""
        with self._lock:
            self._expected.pop(transfer_id, None)
            self._remember_ended(transfer_id, Outcome.ABORTED)
            self.counts[Outcome.ABORTED] += 1
            waiters = self._unpark(transfer_id)
        for wake in waiters:
            wake(True)

    # --- pulls (side-channel threads) --------------------------------------------------------

    def claim(self, transfer_id: str, secret: str, parts: int = 1) -> list[list[int]] | None:
        """Take one of the request's ``parts`` pulls; None if it is expected but not handed
        over yet. ``parts=0``: a release, which ends the request at once (returns []).

        Raises ClaimError if it is unknown, ended, every part is taken (or, for a release,
        one is in flight), the part count disagrees with the first pull's, or the secret is
        wrong (then the request stays held for its rightful decoder).
        """
        with self._lock:
            return self._claim_locked(transfer_id, secret, parts)

    def claim_or_park(
        self, transfer_id: str, secret: str, wait_s: float, waiter: Waiter, parts: int = 1
    ) -> list[list[int]] | None:
        """Claim, or park ``waiter`` until the request is handed over (None: parked).

        ``waiter(True)`` runs (on the handing-over thread) when the request is handed over
        or ends, and the caller claims again; ``waiter(False)`` when ``wait_s`` passes
        (see :meth:`expire_parked`) or the registry closes.
        """
        with self._lock:
            ids = self._claim_locked(transfer_id, secret, parts)
            if ids is not None:
                return ids
            if wait_s <= 0:
                raise ClaimError(f"transfer {safe(transfer_id)} not handed over in time")
            if self._num_parked >= self._max_parked:
                raise ClaimError(
                    f"transfer {safe(transfer_id)}: {self._num_parked} pulls already parked",
                    public="prefiller busy: too many pulls waiting",
                )
            parked = self._parked.get(transfer_id)
            deadline = self._clock() + wait_s
            if parked is None:
                parked = self._parked[transfer_id] = _Parked(deadline)
            parked.deadline = max(parked.deadline, deadline)
            parked.waiters.append(waiter)
            self._num_parked += 1
            return None

    def expire_parked(self) -> int:
        """Time out parked pulls whose wait is over; returns how many."""
        now = self._clock()
        with self._lock:
            due = [tid for tid, p in self._parked.items() if p.deadline <= now]
            waiters = [w for tid in due for w in self._unpark(tid)]
        for wake in waiters:
            wake(False)
        return len(waiters)

    def _claim_locked(self, transfer_id: str, secret: str, parts: int) -> list[list[int]] | None:
        if self._closed:
            raise ClaimError("prefiller is shutting down", public="prefiller is shutting down")
        held = self._held.get(transfer_id)
        if held is not None:
            if not hmac.compare_digest(held.secret.encode(), secret.encode()):
                self.refused_secret += 1
                raise ClaimError(f"wrong secret for transfer {safe(transfer_id)}")
            if parts == 0:  # a release: nobody needs these blocks
                if held.in_flight:
                    raise ClaimError(f"transfer {safe(transfer_id)} is being sent: no release")
                del self._held[transfer_id]
                self._end(transfer_id, Outcome.RELEASED)
                return []
            if held.parts == 0:
                held.parts = parts
            elif parts != held.parts:
                raise ClaimError(
                    f"transfer {safe(transfer_id)}: pull says {parts} parts, the first said "
                    f"{held.parts} (decoder ranks disagree on TP)"
                )
            if held.claimed >= held.parts:
                raise ClaimError(f"transfer {safe(transfer_id)} is already being sent")
            held.claimed += 1
            return [list(g) for g in held.block_ids]
        ended = self._ended.get(transfer_id)
        if ended is not None:
            raise ClaimError(f"transfer {safe(transfer_id)} already ended ({ended.value})")
        if transfer_id in self._expected:
            return None
        raise ClaimError(f"unknown transfer {safe(transfer_id)} (never announced)")

    def _unpark(self, transfer_id: str) -> list[Waiter]:
        parked = self._parked.pop(transfer_id, None)
        if parked is None:
            return []
        self._num_parked -= len(parked.waiters)
        return parked.waiters

    # --- ending ------------------------------------------------------------------------------

    def finish(self, transfer_id: str, outcome: Outcome, hold_s: float = 0.0) -> None:
        """End one claimed part (SENT or FAILED); when the last part ends, the request
        ends and its blocks are freed at the next take_finished().

        ``hold_s``: the engine may still read these blocks (a failed write it can retry
        when the path heals), so they are freed only this long after the request ends.
        """
        with self._lock:
            held = self._held.get(transfer_id)
            if held is None or not held.in_flight:
                return
            held.done += 1
            held.failed = held.failed or outcome != Outcome.SENT
            if hold_s:
                held.hold_until = max(held.hold_until, self._clock() + hold_s)
            if held.done < held.parts:
                return
            del self._held[transfer_id]
            outcome = Outcome.FAILED if held.failed else Outcome.SENT
            self._end(transfer_id, outcome, held.hold_until)

    def expire(self) -> list[str]:
        """End requests older than the expiry with no part in flight (no pull came, or
        some decoder ranks never did); returns their ids."""
        now = self._clock()
        with self._lock:
            stale = [
                tid
                for tid, h in self._held.items()
                if not h.in_flight and now - h.added_at >= self._expiry_s
            ]
            for tid in stale:
                del self._held[tid]
                self._end(tid, Outcome.EXPIRED)
            while self._expected:
                tid, since = next(iter(self._expected.items()))
                if now - since < self._expiry_s:
                    break
                del self._expected[tid]
        return stale

    def take_finished(self) -> set[str]:
        now = self._clock()
        with self._lock:
            done, self._finished = self._finished, set()
            for tid in [t for t, until in self._holding.items() if until <= now]:
                del self._holding[tid]
                done.add(tid)
        return done

    def close(self) -> None:
        """Refuse new claims and wake every parked pull so shutdown waits for nothing."""
        with self._lock:
            self._closed = True
            waiters = [w for tid in list(self._parked) for w in self._unpark(tid)]
        for wake in waiters:
            wake(False)

    def num_held(self) -> int:
        """Requests whose blocks are held: for a decoder, or after a failed write."""
        with self._lock:
            return len(self._held) + len(self._holding)

    def num_parked(self) -> int:
        with self._lock:
            return self._num_parked

    def _end(self, transfer_id: str, outcome: Outcome, free_at: float = 0.0) -> None:
        if free_at > self._clock():
            self._holding[transfer_id] = free_at  # freed by take_finished() from then on
        else:
            self._finished.add(transfer_id)
        self.counts[outcome] += 1
        self._remember_ended(transfer_id, outcome)

    def _remember_ended(self, transfer_id: str, outcome: Outcome) -> None:
        self._ended[transfer_id] = outcome
        self._ended.move_to_end(transfer_id)
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
