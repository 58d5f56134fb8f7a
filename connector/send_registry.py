"""Prefiller-side bookkeeping of requests whose blocks are held for a decoder.

Every held request ends exactly once, by one of: sent, released (decoder needed
nothing), failed (push error: the blocks are still freed, the decoder recomputes), or
expired (no decoder came). Ended ids are reported once to vLLM through
:meth:`SendRegistry.take_finished`, which frees the blocks.
"""

from __future__ import annotations

import enum
import hmac
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


class Outcome(enum.Enum):
    SENT = "sent"
    RELEASED = "released"
    FAILED = "failed"
    EXPIRED = "expired"
    ABORTED = "aborted"  # the prefiller finished the request without holding blocks


class ClaimError(LookupError):
    """A pull named a transfer that cannot be served (unknown, ended, or busy)."""


@dataclass
class _Held:
    # Per KV cache group, the prefiller's block slots (positional, 0 = not held).
    block_ids: list[list[int]]
    secret: str
    added_at: float
    claimed: bool = False


class SendRegistry:
    def __init__(
        self,
        expiry_s: float,
        clock: Callable[[], float] = time.monotonic,
        remember_ended: int = 4096,
    ) -> None:
        self._expiry_s = expiry_s
        self._clock = clock
        self._cond = threading.Condition()
        self._held: dict[str, _Held] = {}
        self._finished: set[str] = set()
        # Recently ended ids, so a late or repeated pull gets a precise error at once.
        self._ended: OrderedDict[str, Outcome] = OrderedDict()
        self._remember = remember_ended
        self.counts: dict[Outcome, int] = dict.fromkeys(Outcome, 0)
        self.refused_secret = 0
        self._closed = False

    def add(self, transfer_id: str, block_ids: list[list[int]], secret: str) -> None:
        with self._cond:
            if transfer_id in self._held or transfer_id in self._ended:
                return
            self._held[transfer_id] = _Held([list(g) for g in block_ids], secret, self._clock())
            self._cond.notify_all()

    def mark_aborted(self, transfer_id: str) -> None:
        """The prefiller dropped the request (e.g. aborted): nothing is held, nothing to free."""
        with self._cond:
            self._remember_ended(transfer_id, Outcome.ABORTED)
            self.counts[Outcome.ABORTED] += 1
            self._cond.notify_all()

    def claim(self, transfer_id: str, timeout_s: float, secret: str) -> list[list[int]]:
        """Take the request for one pull, waiting up to ``timeout_s`` for it to be handed over.

        Raises ClaimError if it never arrives, has already ended, another pull holds it, or
        the secret is wrong (then the request stays held for its rightful decoder).
        """
        deadline = self._clock() + timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise ClaimError("prefiller is shutting down")
                held = self._held.get(transfer_id)
                if held is not None:
                    if not hmac.compare_digest(held.secret.encode(), secret.encode()):
                        self.refused_secret += 1
                        raise ClaimError(f"wrong secret for transfer {transfer_id}")
                    if held.claimed:
                        raise ClaimError(f"transfer {transfer_id} is already being sent")
                    held.claimed = True
                    return [list(g) for g in held.block_ids]
                ended = self._ended.get(transfer_id)
                if ended is not None:
                    raise ClaimError(f"transfer {transfer_id} already ended ({ended.value})")
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise ClaimError(
                        f"unknown transfer {transfer_id} (not handed over within {timeout_s:g}s)"
                    )
                self._cond.wait(remaining)

    def finish(self, transfer_id: str, outcome: Outcome) -> None:
        """End a claimed request; its blocks are freed at the next take_finished()."""
        with self._cond:
            if self._held.pop(transfer_id, None) is None:
                return
            self._end(transfer_id, outcome)

    def expire(self) -> list[str]:
        """End unclaimed requests older than the expiry; returns their ids."""
        now = self._clock()
        with self._cond:
            stale = [
                tid
                for tid, h in self._held.items()
                if not h.claimed and now - h.added_at >= self._expiry_s
            ]
            for tid in stale:
                del self._held[tid]
                self._end(tid, Outcome.EXPIRED)
        return stale

    def take_finished(self) -> set[str]:
        with self._cond:
            done, self._finished = self._finished, set()
        return done

    def close(self) -> None:
        """Wake every waiting claim so shutdown does not wait for ready timeouts."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def num_held(self) -> int:
        with self._cond:
            return len(self._held)

    def _end(self, transfer_id: str, outcome: Outcome) -> None:
        self._finished.add(transfer_id)
        self.counts[outcome] += 1
        self._remember_ended(transfer_id, outcome)
        self._cond.notify_all()

    def _remember_ended(self, transfer_id: str, outcome: Outcome) -> None:
        self._ended[transfer_id] = outcome
        self._ended.move_to_end(transfer_id)
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
