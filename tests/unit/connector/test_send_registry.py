import threading
import time

import pytest

from connector.send_registry import ClaimError, Outcome, SendRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_claim_finish_reports_once():
    reg = SendRegistry(expiry_s=60)
    reg.add("t1", [[1, 2, 3]], "k")
    assert reg.claim("t1", 0.1, "k") == [[1, 2, 3]]
    reg.finish("t1", Outcome.SENT)
    assert reg.take_finished() == {"t1"}
    assert reg.take_finished() == set()
    assert reg.counts[Outcome.SENT] == 1
    reg.finish("t1", Outcome.SENT)  # second finish is a no-op: never freed twice
    assert reg.take_finished() == set()


def test_duplicate_pull_refused_while_sending_and_after():
    reg = SendRegistry(expiry_s=60)
    reg.add("t1", [[1]], "k")
    reg.claim("t1", 0.1, "k")
    with pytest.raises(ClaimError, match="already being sent"):
        reg.claim("t1", 0.1, "k")
    reg.finish("t1", Outcome.SENT)
    with pytest.raises(ClaimError, match="already ended \\(sent\\)"):
        reg.claim("t1", 0.1, "k")


def test_unknown_id_times_out_with_clear_error():
    reg = SendRegistry(expiry_s=60)
    t0 = time.monotonic()
    with pytest.raises(ClaimError, match="unknown transfer nope"):
        reg.claim("nope", 0.2, "k")
    assert 0.15 < time.monotonic() - t0 < 2


def test_claim_waits_for_hand_over():
    reg = SendRegistry(expiry_s=60)
    threading.Timer(0.1, reg.add, args=("late", [[9]], "k")).start()
    assert reg.claim("late", 5, "k") == [[9]]


def test_expiry_frees_unclaimed_only():
    clock = Clock()
    reg = SendRegistry(expiry_s=10, clock=clock)
    reg.add("old", [[1]], "k")
    reg.add("busy", [[2]], "k")
    reg.claim("busy", 0.1, "k")
    clock.now += 5
    reg.add("young", [[3]], "k")
    assert reg.expire() == []
    clock.now += 6
    assert reg.expire() == ["old"]
    assert reg.take_finished() == {"old"}
    assert reg.counts[Outcome.EXPIRED] == 1
    assert reg.num_held() == 2
    with pytest.raises(ClaimError, match="expired"):
        reg.claim("old", 0.01, "k")


def test_aborted_on_prefiller_is_refused_at_once():
    reg = SendRegistry(expiry_s=60)
    reg.mark_aborted("gone")
    t0 = time.monotonic()
    with pytest.raises(ClaimError, match="aborted"):
        reg.claim("gone", 5, "k")
    assert time.monotonic() - t0 < 1
    assert reg.take_finished() == set()  # nothing was held, nothing to free


def test_close_wakes_waiters():
    reg = SendRegistry(expiry_s=60)
    threading.Timer(0.1, reg.close).start()
    t0 = time.monotonic()
    with pytest.raises(ClaimError, match="shutting down"):
        reg.claim("x", 30, "k")
    assert time.monotonic() - t0 < 5


def test_ended_memory_is_bounded():
    reg = SendRegistry(expiry_s=60, remember_ended=3)
    for i in range(5):
        reg.add(f"t{i}", [[i]], "k")
        reg.claim(f"t{i}", 0.1, "k")
        reg.finish(f"t{i}", Outcome.SENT)
    assert len(reg._ended) == 3


def test_wrong_secret_is_refused_and_request_stays_held():
    reg = SendRegistry(expiry_s=60)
    reg.add("t1", [[1, 2]], "right")
    for guess in ("wrong", "", "righ", "right "):
        with pytest.raises(ClaimError, match="wrong secret"):
            reg.claim("t1", 0.1, guess)
    assert reg.refused_secret == 4
    assert reg.claim("t1", 0.1, "right") == [[1, 2]]
