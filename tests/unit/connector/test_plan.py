import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.plan import (
    RegionLayout,
    TransferPlan,
    build_transfer_plan,
    contiguous_runs,
)

PACKED_SRC = RegionLayout((1_000_000, 5_000_000), block_len=100, block_stride=100, num_blocks=64)
PACKED_DST = RegionLayout((9_000_000, 13_000_000), block_len=100, block_stride=100, num_blocks=64)


def reference_segments(src_ids, dst_ids, src: RegionLayout, dst: RegionLayout):
    """The obvious per-block loop, one segment per block, to check merged plans against."""
    out = []
    for r in range(len(src.base_addrs)):
        for s, d in zip(src_ids, dst_ids, strict=True):
            out.append(
                (
                    src.base_addrs[r] + s * src.block_stride,
                    dst.base_addrs[r] + d * dst.block_stride,
                    src.block_len,
                )
            )
    return out


def expand(plan, block_len):
    """Split merged segments back into per-block (src, dst, len) triples."""
    out = []
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist(), strict=True):
        assert n % block_len == 0
        for k in range(n // block_len):
            out.append((s + k * block_len, d + k * block_len, block_len))
    return out


def test_empty():
    runs = contiguous_runs([], [])
    assert len(runs) == 0
    plan = build_transfer_plan([], [], PACKED_SRC, PACKED_DST)
    assert len(plan) == 0 and plan.total_bytes == 0
    assert list(plan.batches(10)) == []


def test_single_block():
    plan = build_transfer_plan([3], [7], PACKED_SRC, PACKED_DST)
    assert plan.src.tolist() == [1_000_300, 5_000_300]
    assert plan.dst.tolist() == [9_000_700, 13_000_700]
    assert plan.lengths.tolist() == [100, 100]


def test_all_contiguous_is_one_segment_per_region():
    plan = build_transfer_plan(range(10, 20), range(30, 40), PACKED_SRC, PACKED_DST)
    assert len(plan) == 2
    assert plan.lengths.tolist() == [1000, 1000]
    assert plan.src.tolist() == [1_001_000, 5_001_000]
    assert plan.dst.tolist() == [9_003_000, 13_003_000]


def test_none_contiguous():
    src, dst = [1, 3, 5, 7], [2, 9, 4, 11]
    plan = build_transfer_plan(src, dst, PACKED_SRC, PACKED_DST)
    assert len(plan) == 8
    assert expand(plan, 100) == reference_segments(src, dst, PACKED_SRC, PACKED_DST)


def test_runs_break_when_either_side_jumps():
    runs = contiguous_runs([1, 2, 3, 10, 11, 12], [5, 6, 20, 21, 22, 23])
    assert runs.src_starts.tolist() == [1, 3, 10]
    assert runs.dst_starts.tolist() == [5, 20, 21]
    assert runs.lengths.tolist() == [2, 1, 3]


def test_mismatched_lengths_rejected():
    with pytest.raises(ValueError, match="differ in length"):
        contiguous_runs([1, 2, 3], [1, 2])


def test_out_of_range_ids_rejected():
    with pytest.raises(ValueError, match="remote block id out of range"):
        build_transfer_plan([1], [64], PACKED_SRC, PACKED_DST)
    with pytest.raises(ValueError, match="local block id out of range"):
        build_transfer_plan([-1], [1], PACKED_SRC, PACKED_DST)


def test_region_and_block_mismatch_rejected():
    one_region = RegionLayout((1,), 100, 100, 64)
    with pytest.raises(ValueError, match="region count differs"):
        build_transfer_plan([1], [1], PACKED_SRC, one_region)
    other_len = RegionLayout((1, 2), 200, 200, 64)
    with pytest.raises(ValueError, match="block length differs"):
        build_transfer_plan([1], [1], PACKED_SRC, other_len)


def test_strided_blocks_are_never_merged():
    # e.g. K and V interleaved per block: a block is 100 B every 200 B.
    strided = RegionLayout((0, 1_000_000), block_len=100, block_stride=200, num_blocks=64)
    plan = build_transfer_plan([1, 2, 3], [1, 2, 3], strided, PACKED_DST)
    assert len(plan) == 6
    assert plan.src.tolist()[:3] == [200, 400, 600]
    assert set(plan.lengths.tolist()) == {100}


def test_concat_plans():
    a = build_transfer_plan([1], [2], PACKED_SRC, PACKED_DST)
    b = build_transfer_plan([5, 6], [7, 8], PACKED_SRC, PACKED_DST)
    both = TransferPlan.concat([a, b])
    assert both.src.tolist() == a.src.tolist() + b.src.tolist()
    assert both.total_bytes == a.total_bytes + b.total_bytes
    assert len(TransferPlan.concat([])) == 0


def test_batches_stay_under_cap_and_cover_everything():
    src = list(range(0, 60, 2))
    plan = build_transfer_plan(src, src, PACKED_SRC, PACKED_DST)
    assert len(plan) == 60
    batches = list(plan.batches(16))
    assert [len(b[0]) for b in batches] == [16, 16, 16, 12]
    flat = [x for b in batches for x in b[0]]
    assert flat == plan.src.tolist()
    assert all(isinstance(x, int) for x in batches[0][0])
    with pytest.raises(ValueError):
        list(plan.batches(0))


@given(
    st.lists(st.integers(0, 63), min_size=0, max_size=40, unique=True),
    st.randoms(use_true_random=False),
)
def test_merged_plan_equals_per_block_reference(src_ids, rnd):
    dst_ids = list(range(64))
    rnd.shuffle(dst_ids)
    dst_ids = dst_ids[: len(src_ids)]
    if rnd.random() < 0.5:  # often contiguous on the decoder side, as in practice
        start = rnd.randrange(0, 64 - len(src_ids) + 1)
        dst_ids = list(range(start, start + len(src_ids)))
    plan = build_transfer_plan(src_ids, dst_ids, PACKED_SRC, PACKED_DST)
    assert expand(plan, 100) == reference_segments(src_ids, dst_ids, PACKED_SRC, PACKED_DST)
    assert plan.total_bytes == 100 * len(src_ids) * 2


def test_large_plan_is_vectorised():
    ids = np.arange(100_000)
    layout = RegionLayout(tuple(range(0, 32 * 10**9, 10**9)), 64, 64, 100_000)
    plan = build_transfer_plan(ids, ids[::-1], layout, layout)
    assert len(plan) == 32 * 100_000
