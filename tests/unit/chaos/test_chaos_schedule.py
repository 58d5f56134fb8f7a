"""The soak's fault schedule: seeded, complete, never overlapping, inside the run."""

import pytest

from scripts.chaos import schedule as S


def test_same_seed_same_plan_other_seed_other_order():
    a = S.plan(11, 1800)
    assert a == S.plan(11, 1800)
    assert [f.kind for f in a] != [f.kind for f in S.plan(12, 1800)]


def test_a_long_run_covers_every_kind_and_targets_both_instances():
    plan = S.plan(11, 1800)
    assert {f.kind for f in plan} == set(S.KINDS)
    for kind in (S.KILL_PREFILL, S.KILL_DECODE, S.STOP_PREFILL, S.STOP_DECODE):
        targets = {f.target for f in plan if f.kind == kind}
        if sum(f.kind == kind for f in plan) >= 2:
            assert targets == {0, 1}, kind


@pytest.mark.parametrize("seed", range(20))
def test_windows_never_overlap_and_fit_the_run(seed):
    settle = 5.0
    plan = S.plan(seed, 600, settle_s=settle)
    assert not S.windows_overlap(plan, settle)
    for f in plan:
        assert f.planned_start_s >= 15.0
        assert f.planned_start_s + f.estimate_s + settle <= 600 - 10
        assert (f.target == -1) == (f.role not in ("prefill", "decode"))
    assert [f.index for f in plan] == list(range(len(plan)))


def test_each_kind_once_before_any_repeats():
    plan = S.plan(5, 3600)
    first = [f.kind for f in plan[: len(S.KINDS)]]
    assert sorted(first) == sorted(S.KINDS)


def test_freezes_and_partitions_hold_longer_than_the_timeouts():
    plan = S.plan(1, 1800, hold_s=12.0)
    held = [f for f in plan if f.kind in (*S.PARTITIONS, S.STOP_PREFILL, S.STOP_DECODE)]
    assert held and all(f.hold_s == 12.0 for f in held)
    assert all(f.hold_s == 0 for f in plan if f.kind in (S.KILL_PREFILL, S.POISON_400))


def test_subset_short_run_and_unknown_kind():
    plan = S.plan(3, 180, [S.STOP_DECODE, S.POISON_400], warmup_s=10, gap_s=(2, 4))
    assert {f.kind for f in plan} <= {S.STOP_DECODE, S.POISON_400} and len(plan) >= 3
    assert S.plan(3, 20) == []  # nothing fits
    assert S.plan(3, 600, []) == []
    with pytest.raises(ValueError):
        S.plan(3, 600, ["meteor_strike"])


def test_overlap_detector():
    f = S.PlannedFault
    a = f(0, S.POISON_400, "client", -1, 10.0, 0.0, 2.0)
    b = f(1, S.POISON_500, "client", -1, 16.0, 0.0, 2.0)
    assert not S.windows_overlap([a, b], settle_s=4.0)
    assert S.windows_overlap([a, b], settle_s=4.5)
