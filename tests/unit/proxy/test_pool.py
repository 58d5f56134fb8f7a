"""Pure logic: instance pool, policies, leases, draining, circuit breaker."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from proxy.pool import CircuitBreaker, Pool
from proxy.settings import BreakerSettings, InstanceSpec


def specs(n: int, weights=None) -> list[InstanceSpec]:
    return [
        InstanceSpec(f"http://127.0.0.1:{9000 + i}", (weights or [1.0] * n)[i]) for i in range(n)
    ]


def test_round_robin_is_weighted_and_smooth():
    pool = Pool("decode", specs(3, [1, 2, 1]), "round_robin")
    picks = [pool.pick().url[-4:] for _ in range(8)]
    assert Counter(picks) == {"9000": 2, "9001": 4, "9002": 2}
    assert picks[:4].count("9001") == 2  # smooth: the heavy one is not picked in a burst


def test_least_loaded_counts_requests_until_release():
    pool = Pool("decode", specs(2), "least_loaded", rng=random.Random(0))
    a = pool.pick()
    la = pool.lease(a, 10)
    assert pool.pick() is not a  # a has one in flight
    lb = pool.lease(pool.pick(), 10)
    la.release()
    la.release()  # idempotent
    assert a.inflight == 0 and pool.pick() is a
    lb.release()


def test_prefill_least_loaded_weighs_prompt_tokens():
    pool = Pool("prefill", specs(2), "least_loaded", rng=random.Random(0))
    a, b = pool.instances
    long = pool.lease(a, 5000)
    shorts = [pool.lease(b, 10) for _ in range(3)]
    assert pool.pick() is b  # 30 tokens in flight beat one 5000-token prompt
    long.release()
    assert pool.pick() is a
    for s in shorts:
        s.release()


def test_power_of_two_avoids_the_busier_of_two():
    pool = Pool("decode", specs(2), "power_of_two", rng=random.Random(1))
    a, b = pool.instances
    leases = [pool.lease(a) for _ in range(5)]
    assert all(pool.pick() is b for _ in range(20))
    for le in leases:
        le.release()


def test_prefix_affinity_is_sticky_and_consistent():
    pool = Pool("prefill", specs(4), "prefix", rng=random.Random(0))
    owners = {k: pool.pick(f"prefix-{k}".encode()).url for k in range(50)}
    assert all(pool.pick(f"prefix-{k}".encode()).url == owners[k] for k in range(50))
    assert len(set(owners.values())) == 4  # keys spread over every instance
    # Removing one instance only moves the keys it owned.
    gone = pool.instances[0].url
    pool.remove(gone)
    moved = [
        k
        for k in owners
        if owners[k] != gone and pool.pick(f"prefix-{k}".encode()).url != owners[k]
    ]
    assert moved == []


def test_prefix_affinity_load_bound_spills_a_hot_prefix():
    pool = Pool("decode", specs(3), "prefix", load_factor=1.25, rng=random.Random(0))
    key = b"the same system prompt"
    owner = pool.pick(key)
    leases = []
    for _ in range(30):
        inst = pool.pick(key)
        leases.append(pool.lease(inst))
    counts = sorted(i.inflight for i in pool.instances)
    assert owner.inflight == max(counts)
    assert counts[-1] <= 1.25 * 30 / 3 + 1  # nobody above the bound
    assert counts[0] > 0  # the hot prefix spilled over
    for le in leases:
        le.release()


def test_unhealthy_draining_and_open_breaker_are_skipped():
    events: list[tuple[str, str, str, str]] = []
    pool = Pool("decode", specs(4), "round_robin", on_event=lambda *e: events.append(e))
    a, b, c, d = pool.instances
    a.healthy = False
    lease = pool.lease(b)
    pool.remove(b.url)
    assert b.draining and pool.get(b.url) is b  # still there: one in flight
    for _ in range(3):
        pool.failure(c, "gateway")
    assert c.breaker.state == "open" and ("ejected", "decode", "gateway", c.url) in events
    assert {pool.pick().url for _ in range(4)} == {d.url}
    d.healthy = False
    assert pool.pick() is None and not pool.has_eligible()
    # Panic routing: health and breaker ignored, draining still excluded.
    assert {pool.pick(panic=True).url for _ in range(6)} == {a.url, c.url, d.url}
    assert ("panic", "decode", "no_eligible", a.url) in events
    lease.release()
    assert pool.get(b.url) is None  # drained and gone
    a.healthy = True
    assert {pool.pick().url for _ in range(4)} == {a.url}


def test_panic_pick_is_none_only_with_no_instance_taking_legs():
    pool = Pool("decode", specs(2), "round_robin")
    for inst in pool.instances:
        inst.healthy = False
    assert pool.has_members() and pool.could_pick(panic=True) and not pool.could_pick()
    for url in pool.urls:
        pool.remove(url)
    assert not pool.has_members() and pool.pick(panic=True) is None


def test_remove_idle_is_immediate_and_add_duplicate_refused():
    pool = Pool("prefill", specs(1), "round_robin")
    with pytest.raises(ValueError):
        pool.add(specs(1)[0])
    pool.remove(specs(1)[0].url)
    assert pool.instances == []
    with pytest.raises(KeyError):
        pool.remove("http://127.0.0.1:1")


def test_exclude_gives_another_instance_for_retries():
    pool = Pool("prefill", specs(2), "round_robin")
    first = pool.pick()
    assert pool.pick(exclude=[first]) is not first
    assert pool.pick(exclude=pool.instances) is None


def breaker(clock=None, **kw) -> CircuitBreaker:
    settings = BreakerSettings(**{"gateway_failures": 2, "answer_failures": 3, "open_s": 10, **kw})
    return CircuitBreaker(settings, clock=clock) if clock else CircuitBreaker(settings)


def test_circuit_breaker_opens_half_opens_and_closes():
    now = [0.0]
    br = breaker(lambda: now[0])
    assert br.failure("gateway") is None
    assert br.state == "closed" and br.allows()
    assert br.failure("gateway") == "ejected"
    assert br.state == "open" and not br.allows()
    now[0] = 10.0
    assert br.state == "half_open" and br.allows()
    assert br.on_pick() is not None
    assert not br.allows()  # one trial at a time
    assert br.on_pick() is None
    assert br.failure("gateway") == "ejected"  # the trial failed
    assert br.state == "open"
    now[0] = 20.0
    br.on_pick()
    br.success()
    assert br.state == "closed" and br.allows()


def test_success_resets_the_failure_count():
    br = breaker()
    br.failure("gateway")
    br.success()
    br.failure("gateway")
    assert br.state == "closed"


def test_gateway_failures_and_5xx_answers_have_their_own_thresholds():
    br = breaker()
    br.failure("answer")
    br.failure("answer")
    br.failure("gateway")  # 2 answers + 1 gateway: neither count is at its threshold
    assert br.state == "closed"
    assert br.failure("answer") == "ejected"  # the third 5xx in a row


def test_answer_failures_zero_never_ejects_on_5xx():
    now = [0.0]
    br = breaker(lambda: now[0], answer_failures=0)
    for _ in range(50):
        assert br.failure("answer") is None
    assert br.state == "closed"
    br.failure("gateway")
    br.failure("gateway")
    now[0] = 10.0
    trial = br.on_pick()
    assert br.failure("answer") is None  # a 5xx is no verdict on health: the trial goes back
    assert br.state == "half_open" and br.allows() and trial is not None


def test_deprecated_failures_sets_both_thresholds():
    s = BreakerSettings(failures=4)
    assert (s.gateway_failures, s.answer_failures) == (4, 4)
    with pytest.raises(ValueError, match="deprecated"):
        BreakerSettings(failures=4, gateway_failures=2)
    for bad in ({"gateway_failures": -1}, {"answer_failures": 1.5}, {"open_s": 0}):
        with pytest.raises(ValueError):
            BreakerSettings(**bad)
    with pytest.raises(ValueError):
        BreakerSettings(max_ejection_percent=101)


def test_the_last_serving_instance_is_never_ejected():
    """One decoder and a run of poison requests: it stays in (the issue's total outage)."""
    events: list[tuple[str, ...]] = []
    pool = Pool(
        "decode",
        specs(1),
        breaker=BreakerSettings(answer_failures=3),
        on_event=lambda *e: events.append(e),
    )
    (only,) = pool.instances
    for _ in range(10):
        pool.failure(only, "answer")
    assert only.breaker.state == "closed" and pool.pick() is only
    assert events.count(("ejection_refused", "decode", "answer", only.url)) == 8


def test_ejection_share_is_capped_by_max_ejection_percent():
    pool = Pool("decode", specs(4), breaker=BreakerSettings(gateway_failures=1))
    insts = pool.instances
    for inst in insts:
        pool.failure(inst, "gateway")
    assert [i.breaker.ejected for i in insts] == [True, True, False, False]  # 50% of 4
    tenth = Pool(
        "decode", specs(4), breaker=BreakerSettings(gateway_failures=1, max_ejection_percent=10)
    )
    for inst in tenth.instances:
        tenth.failure(inst, "gateway")
    assert sum(i.breaker.ejected for i in tenth.instances) == 1  # at least one when > 0
    none = Pool(
        "decode", specs(2), breaker=BreakerSettings(gateway_failures=1, max_ejection_percent=0)
    )
    for inst in none.instances:
        none.failure(inst, "gateway")
    assert not any(i.breaker.ejected for i in none.instances)


def two_with_a_clock(now: list[float]) -> Pool:
    """Two decoders ejected after one gateway failure for 5 s of ``now[0]``'s clock."""
    breaker = BreakerSettings(gateway_failures=1, open_s=5)
    return Pool("decode", specs(2), breaker=breaker, clock=lambda: now[0])


def test_refused_ejection_happens_once_room_returns():
    now = [0.0]
    pool = two_with_a_clock(now)
    a, b = pool.instances
    pool.failure(a, "gateway")
    pool.failure(b, "gateway")
    assert a.breaker.ejected and not b.breaker.ejected  # b is the last one serving
    b.healthy = False
    pool.failure(b, "gateway")
    assert not b.breaker.ejected  # a is ejected, b the last (if sick) instance
    now[0] = 5.0
    pool.lease(a).release()  # a's trial went back with no verdict
    pool.success(a)
    b.healthy = True
    pool.failure(b, "gateway")
    assert b.breaker.ejected and not a.breaker.ejected


def test_a_trial_that_ends_with_no_verdict_goes_back():
    """A client that hangs up during the half-open trial must not block the instance."""
    now = [0.0]
    pool = two_with_a_clock(now)
    a, _ = pool.instances
    pool.failure(a, "gateway")
    now[0] = 5.0
    hung_up = pool.lease(a)
    assert not a.eligible()  # the trial is out
    hung_up.release()  # cancelled: no success, no failure
    assert a.eligible()
    second = pool.lease(a)
    pool.failure(a, "gateway")  # the second trial fails: open again
    now[0] = 10.0
    third = pool.lease(a)  # a new trial
    second.release()  # the old lease's release must not hand back the new trial
    assert not a.eligible()
    third.release()
    assert a.eligible()
