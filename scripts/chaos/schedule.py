"""Pure fault schedule: which fault, on which instance, when, drawn from a seed.

Faults never overlap: each one's window is [start, end + settle], and the next fault is
planned only after the previous window plus a quiet gap, so every error can be blamed on
at most one fault and the quiet gaps measure the success rate outside faults. The planned
times are estimates (a restart takes as long as it takes); the runner starts each fault at
its planned time or when the previous window closed, whichever is later, and records what
really happened.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import asdict, dataclass

# Kind -> (role of the target, estimated seconds from start to end, before the settle).
KILL_PREFILL = "kill_prefill"
KILL_DECODE = "kill_decode"
STOP_PREFILL = "stop_prefill"
STOP_DECODE = "stop_decode"
BLOCK_SIDE_CHANNEL = "block_side_channel"
BLOCK_MOONCAKE = "block_mooncake"
HANGUP_BEFORE_PREFILL = "hangup_before_prefill"
HANGUP_BETWEEN_LEGS = "hangup_between_legs"
HANGUP_MID_STREAM = "hangup_mid_stream"
POISON_400 = "poison_400"
POISON_500 = "poison_500"
ADMIN_REMOVE_ADD = "admin_remove_add"

KINDS: dict[str, tuple[str, float]] = {
    KILL_PREFILL: ("prefill", 30.0),
    KILL_DECODE: ("decode", 30.0),
    STOP_PREFILL: ("prefill", 12.0),
    STOP_DECODE: ("decode", 12.0),
    BLOCK_SIDE_CHANNEL: ("kv-net", 12.0),
    BLOCK_MOONCAKE: ("kv-net", 12.0),
    HANGUP_BEFORE_PREFILL: ("client", 3.0),
    HANGUP_BETWEEN_LEGS: ("client", 3.0),
    HANGUP_MID_STREAM: ("client", 3.0),
    POISON_400: ("client", 2.0),
    POISON_500: ("client", 2.0),
    ADMIN_REMOVE_ADD: ("decode", 15.0),
}
PARTITIONS = (BLOCK_SIDE_CHANNEL, BLOCK_MOONCAKE)
# Process faults: the instance is gone or frozen, then comes back (recovery is measured).
PROCESS = (KILL_PREFILL, KILL_DECODE, STOP_PREFILL, STOP_DECODE)


@dataclass(frozen=True)
class PlannedFault:
    index: int
    kind: str
    role: str
    target: int  # instance index within its role (0 or 1); -1 for client and network faults
    planned_start_s: float  # seconds after load start
    hold_s: float  # how long the fault is applied (freeze, partition, drain) where it applies
    estimate_s: float  # estimated start -> end

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def plan(
    seed: int,
    duration_s: float,
    kinds: list[str] | None = None,
    *,
    warmup_s: float = 15.0,
    settle_s: float = 5.0,
    gap_s: tuple[float, float] = (8.0, 20.0),
    per_role: int = 2,
    hold_s: float = 12.0,
    tail_s: float = 10.0,
) -> list[PlannedFault]:
    """Faults in a seeded order, cycling through ``kinds`` until ``duration_s`` is used.

    Every kind appears once (in a shuffled order) before any kind repeats, so a run long
    enough for one cycle covers every fault; targets alternate between instances. A fault
    whose estimate does not fit before ``duration_s - tail_s`` ends the plan.
    """
    kinds = list(kinds if kinds is not None else KINDS)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown fault kinds: {unknown}")
    if not kinds:
        return []
    rng = random.Random(seed)
    out: list[PlannedFault] = []
    t = warmup_s
    next_target: dict[str, int] = {}
    while True:
        cycle = kinds[:]
        rng.shuffle(cycle)
        for kind in cycle:
            role, estimate = KINDS[kind]
            held = hold_s if kind in (*PARTITIONS, STOP_PREFILL, STOP_DECODE) else 0.0
            if kind == ADMIN_REMOVE_ADD:
                held = hold_s
            est = max(estimate, held)
            if t + est + settle_s > duration_s - tail_s:
                return out
            if role not in ("prefill", "decode"):
                target = -1
            else:
                target = next_target.get(kind, rng.randrange(per_role))
                next_target[kind] = (target + 1) % per_role
            out.append(PlannedFault(len(out), kind, role, target, round(t, 3), held, est))
            t += est + settle_s + rng.uniform(*gap_s)


def windows_overlap(faults: list[PlannedFault], settle_s: float) -> bool:
    """True if two planned windows [start, start + estimate + settle] overlap."""
    spans = sorted((f.planned_start_s, f.planned_start_s + f.estimate_s + settle_s) for f in faults)
    return any(b[0] < a[1] for a, b in itertools.pairwise(spans))
