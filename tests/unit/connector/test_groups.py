"""Group specs from real vLLM KVCacheConfig objects, and positional block pairing."""

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from connector.groups import GroupSpec, group_specs, pair_blocks


def attn(cls, **kw):
    return cls(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, **kw)


def config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=list(groups))


def test_hybrid_config_gives_one_spec_per_transfer_group():
    cfg = config(
        KVCacheGroupSpec(["l0", "l2"], attn(SlidingWindowSpec, sliding_window=64)),
        KVCacheGroupSpec(["l1", "l3"], attn(FullAttentionSpec)),
    )
    assert group_specs(cfg) == (
        GroupSpec("sliding:64", 32, ("l0", "l2")),
        GroupSpec("full", 32, ("l1", "l3")),
    )


def test_groups_without_transfer_are_left_out():
    cfg = config(
        KVCacheGroupSpec(["l0"], attn(FullAttentionSpec)),
        KVCacheGroupSpec(["draft"], attn(FullAttentionSpec), enable_kv_transfer=False),
    )
    assert [g.layer_names for g in group_specs(cfg)] == [("l0",)]
    assert cfg.transfer_group_ids == (0,)


def test_state_groups_are_refused_clearly():
    mamba = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(NotImplementedError, match="MambaSpec"):
        group_specs(config(KVCacheGroupSpec(["m0"], mamba)))


def test_pairing_is_tail_aligned():
    assert pair_blocks([4, 5, 6, 7], [10, 11]) == ([6, 7], [10, 11])
    assert pair_blocks([4, 5], [8, 9]) == ([4, 5], [8, 9])
    assert pair_blocks([4, 5], []) == ([], [])


def test_null_slots_never_pair_with_real_blocks():
    # Sliding window: out-of-window slots are the null block 0, on either side.
    assert pair_blocks([0, 0, 7, 8, 9], [3, 4, 5, 6, 1]) == ([7, 8, 9], [5, 6, 1])
    assert pair_blocks([5, 6, 7], [0, 2, 3]) == ([6, 7], [2, 3])
    assert pair_blocks([0, 0], [0, 0]) == ([], [])


def test_asking_for_more_than_was_computed_is_refused():
    with pytest.raises(ValueError, match="asked for 3 blocks but only 2"):
        pair_blocks([1, 2], [3, 4, 5])
