"""Who pulls which KV heads from whom when prefill and decode use different TP sizes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from connector.plan import RegionLayout, build_transfer_plan
from connector.tp import HeadSpan, Pull, byte_slice, check_tp, cover, rank_heads


def test_rank_heads_split_and_replicate_as_vllm_does():
    assert [rank_heads(8, 4, r) for r in range(4)] == [HeadSpan(2 * r, 2) for r in range(4)]
    # More ranks than heads: each head on tp/H ranks, rank r holds head r*H//tp.
    assert [rank_heads(2, 4, r).first for r in range(4)] == [0, 0, 1, 1]
    assert rank_heads(1, 8, 5) == HeadSpan(0, 1)  # MLA: one latent "head" everywhere
    for bad in ((6, 4), (2, 3), (0, 1)):
        with pytest.raises(ValueError):
            check_tp(*bad)


def test_equal_tp_is_rank_to_rank_whole():
    c = cover(8, 4, 4)
    assert c.pulls == tuple(Pull(r, r, HeadSpan(2 * r, 2)) for r in range(4))
    assert c.releases == () and all(c.expected_at(r) == 1 for r in range(4))


def test_prefill_2_to_decode_1_pulls_both_halves():
    c = cover(2, 2, 1)
    assert c.pulls_of(0) == [Pull(0, 0, HeadSpan(0, 1)), Pull(0, 1, HeadSpan(1, 1))]
    assert c.expected_at(0) == c.expected_at(1) == 1
    s0, s1 = (byte_slice(p, 2, 2, 1, head_bytes=100) for p in c.pulls_of(0))
    assert (s0.src_offset, s0.dst_offset, s0.length) == (0, 0, 100)
    assert (s1.src_offset, s1.dst_offset, s1.length) == (0, 100, 100)


def test_prefill_1_to_decode_2_each_rank_takes_its_half():
    c = cover(2, 1, 2)
    assert c.pulls == (Pull(0, 0, HeadSpan(0, 1)), Pull(1, 0, HeadSpan(1, 1)))
    assert c.expected_at(0) == 2  # one prefiller rank, two pulls end a request
    s = byte_slice(c.pulls[1], 2, 1, 2, head_bytes=100)
    assert (s.src_offset, s.dst_offset, s.length) == (100, 0, 100)


def test_replicated_prefill_heads_are_spread_and_the_unused_copies_released():
    c = cover(2, 4, 1)  # P ranks hold heads 0,0,1,1
    assert [p.prefill_rank for p in c.pulls_of(0)] == [0, 2]
    assert c.releases == ((0, 1), (0, 3))
    assert c.release_targets(0, 4) == [0, 1, 2, 3]
    c = cover(2, 4, 2)  # D rank d holds head d
    assert [(p.decode_rank, p.prefill_rank) for p in c.pulls] == [(0, 0), (1, 3)]
    assert c.owner_of(1) == 1 % 2 and c.owner_of(2) == 0


@pytest.mark.parametrize(
    "heads,p_tp,d_tp",
    [(h, m, n) for h in (1, 2, 4, 8) for m, n in itertools.product((1, 2, 4, 8), repeat=2)],
)
def test_every_decoder_head_once_and_every_prefiller_rank_hears_once(heads, p_tp, d_tp):
    c = cover(heads, p_tp, d_tp)
    for d in range(d_tp):
        want = rank_heads(heads, d_tp, d)
        got = sorted((p.heads.first, p.heads.end) for p in c.pulls_of(d))
        assert got[0][0] == want.first and got[-1][1] == want.end
        assert all(a[1] == b[0] for a, b in itertools.pairwise(got))  # no gap, no overlap
        for p in c.pulls_of(d):  # a prefiller rank only gives heads it holds
            have = rank_heads(heads, p_tp, p.prefill_rank)
            assert have.first <= p.heads.first and p.heads.end <= have.end
        assert len({p.prefill_rank for p in c.pulls_of(d)}) == len(c.pulls_of(d))
    # Each prefiller rank gets pulls, or exactly one release; the owner is well defined.
    for p in range(p_tp):
        releases = [q for _, q in c.releases if q == p]
        assert (c.expected_at(p) > 0) != (len(releases) == 1)
        assert sum(p in c.release_targets(d, p_tp) for d in range(d_tp)) == 1


def test_sliced_plan_copies_one_heads_bytes_into_place():
    """P TP=1 (2 heads per block) -> D rank 1 (head 1): the second half of each block."""
    hb = 8
    src = RegionLayout((1000, 5000), 2 * hb, 2 * hb, 10)
    dst = RegionLayout((9000, 9500), hb, hb, 10)
    part = byte_slice(cover(2, 1, 2).pulls[1], 2, 1, 2, hb)
    plan = build_transfer_plan([3, 4], [7, 8], src, dst, part)
    assert plan.src.tolist() == [1000 + 3 * 16 + 8, 1000 + 4 * 16 + 8, 5000 + 56, 5000 + 72]
    assert plan.dst.tolist() == [9000 + 56, 9000 + 64, 9500 + 56, 9500 + 64]
    assert plan.lengths.tolist() == [hb] * 4  # sliced: never merged across blocks
    whole = build_transfer_plan(
        [3, 4], [7, 8], dst, dst, byte_slice(Pull(0, 0, HeadSpan(0, 1)), 1, 1, 1, hb)
    )
    assert whole.lengths.tolist() == [2 * hb] * 2  # a whole-block "slice" merges as before


def test_sliced_plan_refuses_bytes_outside_either_block():
    src = RegionLayout((0,), 16, 16, 4)
    dst = RegionLayout((100,), 8, 8, 4)
    with pytest.raises(ValueError, match="outside the remote block"):
        build_transfer_plan([1], [1], src, dst, byte_slice(Pull(0, 0, HeadSpan(0, 2)), 2, 1, 1, 8))
    with pytest.raises(ValueError, match="block length differs"):
        build_transfer_plan([1], [1], src, dst)
    assert np.array_equal(
        build_transfer_plan(
            [1], [1], src, dst, byte_slice(Pull(1, 0, HeadSpan(1, 1)), 2, 1, 2, 8)
        ).src,
        [16 + 8],
    )
