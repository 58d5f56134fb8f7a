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
