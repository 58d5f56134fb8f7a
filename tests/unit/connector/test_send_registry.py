import pytest

from connector.send_registry import UNAVAILABLE, ClaimError, Outcome, SendRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_claim_finish_reports_once():
    reg = SendRegistry(expiry_s=60)
    reg.add("t1", [[1, 2, 3]], "k")
    assert reg.claim("t1", "k") == [[1, 2, 3]]
    reg.finish("t1", Outcome.SENT)
    assert reg.take_finished() == {"t1"}
    assert reg.take_finished() == set()
    assert reg.counts[Outcome.SENT] == 1
    reg.finish("t1", Outcome.SENT)  # second finish is a no-op: never freed twice
    assert reg.take_finished() == set()


def test_duplicate_pull_refused_while_sending_and_after():
    reg = SendRegistry(expiry_s=60)
    reg.add("t1", [[1]], "k")
    reg.claim("t1", "k")
    with pytest.raises(ClaimError) as busy:
        reg.claim("t1", "k")
    assert "already being sent" in busy.value.detail
    reg.finish("t1", Outcome.SENT)
    with pytest.raises(ClaimError) as ended:
        reg.claim("t1", "k")
    assert "already ended (sent)" in ended.value.detail


def test_refusals_look_the_same_to_the_peer():
    """Unknown, ended, busy and wrong-secret must not tell a prober which ids are held."""
    reg = SendRegistry(expiry_s=60)
    reg.add("held", [[1]], "k")
    reg.add("ended", [[2]], "k")
    reg.claim("ended", "k")
    reg.finish("ended", Outcome.SENT)
    publics = set()
    for tid, secret in (("never", "k"), ("ended", "k"), ("held", "guess")):
        with pytest.raises(ClaimError) as exc:
            reg.claim(tid, secret)
        publics.add(str(exc.value))
    reg.claim("held", "k")
    with pytest.raises(ClaimError) as exc:
        reg.claim("held", "k")
    publics.add(str(exc.value))
    assert publics == {UNAVAILABLE}


def test_unknown_id_is_refused_at_once_and_never_parks():
    reg = SendRegistry(expiry_s=60)
    woken: list[bool] = []
    with pytest.raises(ClaimError) as exc:
        reg.claim_or_park("nope", "k", 30, woken.append)
    assert "never announced" in exc.value.detail
    assert reg.num_parked() == 0 and woken == []


def test_expected_id_parks_without_a_thread_and_wakes_on_hand_over():
    reg = SendRegistry(expiry_s=60)
    reg.expect("late")
    woken: list[bool] = []
    assert reg.claim_or_park("late", "k", 30, woken.append) is None
    assert reg.num_parked() == 1 and woken == []
    reg.add("late", [[9]], "k")
    assert woken == [True] and reg.num_parked() == 0
    assert reg.claim("late", "k") == [[9]]


def test_parked_pull_times_out():
    clock = Clock()
    reg = SendRegistry(expiry_s=60, clock=clock)
    reg.expect("slow")
    woken: list[bool] = []
    reg.claim_or_park("slow", "k", 2, woken.append)
    clock.now += 1
    assert reg.expire_parked() == 0
    clock.now += 1.5
    assert reg.expire_parked() == 1 and woken == [False]
    assert reg.num_parked() == 0


def test_parking_is_capped():
    reg = SendRegistry(expiry_s=60, max_parked=3)
    reg.expect("t")
    for _ in range(3):
        assert reg.claim_or_park("t", "k", 30, lambda ok: None) is None
    with pytest.raises(ClaimError, match="too many pulls waiting"):
        reg.claim_or_park("t", "k", 30, lambda ok: None)
    assert reg.num_parked() == 3


def test_expected_ids_are_bounded_and_expire():
    clock = Clock()
    reg = SendRegistry(expiry_s=10, clock=clock, max_expected=2)
    for tid in ("a", "b", "c"):
        reg.expect(tid)
    with pytest.raises(ClaimError):  # "a" fell out of the bounded set
        reg.claim_or_park("a", "k", 5, lambda ok: None)
    clock.now += 11
    reg.expire()
    with pytest.raises(ClaimError):
        reg.claim_or_park("c", "k", 5, lambda ok: None)


def test_abort_of_an_expected_id_wakes_its_parked_pull_to_a_refusal():
    reg = SendRegistry(expiry_s=60)
    reg.expect("x")
    woken: list[bool] = []
    reg.claim_or_park("x", "k", 30, woken.append)
    reg.mark_aborted("x")
    assert woken == [True]
    with pytest.raises(ClaimError) as exc:
        reg.claim("x", "k")
    assert "aborted" in exc.value.detail


def test_duplicate_hand_over_is_freed_not_stranded():
    """A reused request id must not leave the second request's blocks held forever."""
    reg = SendRegistry(expiry_s=60)
    reg.add("t", [[1]], "k")
    reg.claim("t", "k")
    reg.finish("t", Outcome.SENT)
    assert reg.take_finished() == {"t"}
    reg.add("t", [[2]], "k2")  # same id handed over again
    assert reg.take_finished() == {"t"}
    assert reg.duplicates == 1 and reg.num_held() == 0


def test_expiry_frees_unclaimed_only():
    clock = Clock()
    reg = SendRegistry(expiry_s=10, clock=clock)
    reg.add("old", [[1]], "k")
    reg.add("busy", [[2]], "k")
    reg.claim("busy", "k")
    clock.now += 5
    reg.add("young", [[3]], "k")
    assert reg.expire() == []
    clock.now += 6
    assert reg.expire() == ["old"]
    assert reg.take_finished() == {"old"}
    assert reg.counts[Outcome.EXPIRED] == 1
    assert reg.num_held() == 2
    with pytest.raises(ClaimError) as exc:
        reg.claim("old", "k")
    assert "expired" in exc.value.detail


def test_aborted_on_prefiller_is_refused_at_once():
    reg = SendRegistry(expiry_s=60)
    reg.mark_aborted("gone")
    with pytest.raises(ClaimError) as exc:
        reg.claim_or_park("gone", "k", 5, lambda ok: None)
    assert "aborted" in exc.value.detail
    assert reg.take_finished() == set()  # nothing was held, nothing to free


def test_close_wakes_parked_pulls_and_refuses_new_ones():
    reg = SendRegistry(expiry_s=60)
    reg.expect("x")
    woken: list[bool] = []
    reg.claim_or_park("x", "k", 30, woken.append)
    reg.close()
    assert woken == [False]
    with pytest.raises(ClaimError, match="shutting down"):
        reg.claim("x", "k")


def test_ended_memory_is_bounded():
    reg = SendRegistry(expiry_s=60, remember_ended=3)
    for i in range(5):
        reg.add(f"t{i}", [[i]], "k")
        reg.claim(f"t{i}", "k")
        reg.finish(f"t{i}", Outcome.SENT)
    assert len(reg._ended) == 3


def test_wrong_secret_is_refused_and_request_stays_held():
    reg = SendRegistry(expiry_s=60)
    reg.add("t1", [[1, 2]], "right")
    for guess in ("wrong", "", "righ", "right "):
        with pytest.raises(ClaimError) as exc:
            reg.claim("t1", guess)
        assert "wrong secret" in exc.value.detail
    assert reg.refused_secret == 4
    assert reg.claim("t1", "right") == [[1, 2]]


# -- requests pulled in parts (decoder ranks of another TP size) ---------------------------


def test_a_request_in_parts_ends_when_the_last_part_ends():
    reg = SendRegistry(expiry_s=60)
    reg.add("t", [[1, 2]], "k")
    assert reg.claim("t", "k", parts=2) == [[1, 2]]
    assert reg.claim("t", "k", parts=2) == [[1, 2]]
    with pytest.raises(ClaimError, match=UNAVAILABLE):
        reg.claim("t", "k", parts=2)  # a third decoder rank: no such part
    reg.finish("t", Outcome.SENT)
    assert reg.take_finished() == set() and reg.num_held() == 1
    reg.finish("t", Outcome.SENT)
    assert reg.take_finished() == {"t"} and reg.counts[Outcome.SENT] == 1


def test_one_failed_part_fails_the_request_but_waits_for_the_other():
    reg = SendRegistry(expiry_s=60)
    reg.add("t", [[1]], "k")
    reg.claim("t", "k", parts=2)
    reg.claim("t", "k", parts=2)
    reg.finish("t", Outcome.FAILED)
    assert reg.take_finished() == set()  # the other part may still be reading the blocks
    reg.finish("t", Outcome.SENT)
    assert reg.take_finished() == {"t"} and reg.counts[Outcome.FAILED] == 1


def test_decoder_ranks_that_disagree_on_the_part_count_are_refused():
    reg = SendRegistry(expiry_s=60)
    reg.add("t", [[1]], "k")
    reg.claim("t", "k", parts=2)
    with pytest.raises(ClaimError) as exc:
        reg.claim("t", "k", parts=4)
    assert "disagree" in exc.value.detail and reg.num_held() == 1


def test_release_ends_the_request_whole_unless_a_part_is_in_flight():
    reg = SendRegistry(expiry_s=60)
    reg.add("a", [[1]], "k")
    assert reg.claim("a", "k", parts=0) == []
    assert reg.take_finished() == {"a"} and reg.counts[Outcome.RELEASED] == 1
    reg.add("b", [[1]], "k")
    reg.claim("b", "k", parts=2)
    with pytest.raises(ClaimError) as exc:
        reg.claim("b", "k", parts=0)
    assert "being sent" in exc.value.detail
    with pytest.raises(ClaimError):
        reg.claim("a", "wrong", parts=0)


def test_a_missing_part_expires_once_nothing_is_in_flight():
    clock = Clock()
    reg = SendRegistry(expiry_s=10, clock=clock)
    reg.add("t", [[1]], "k")
    reg.claim("t", "k", parts=2)
    clock.now += 11
    assert reg.expire() == []  # part one is being pushed: never free under it
    reg.finish("t", Outcome.SENT)
    assert reg.take_finished() == set()
    assert reg.expire() == ["t"]  # the second decoder rank never came
    assert reg.take_finished() == {"t"} and reg.counts[Outcome.EXPIRED] == 1


def test_blocks_of_a_failed_engine_write_are_held_before_they_are_freed():
    """The engine may deliver a failed write later, reading our blocks then: they must
    still hold this request's KV (the chaos soak's wrong answers), so they wait."""
    clock = Clock()
    reg = SendRegistry(expiry_s=60, clock=clock)
    reg.add("t", [[1]], "k")
    reg.claim("t", "k")
    reg.finish("t", Outcome.FAILED, hold_s=30)
    assert reg.take_finished() == set() and reg.num_held() == 1
    with pytest.raises(ClaimError):
        reg.claim("t", "k")  # ended: no new pull gets it
    clock.now += 30
    assert reg.take_finished() == {"t"} and reg.num_held() == 0
    assert reg.counts[Outcome.FAILED] == 1
