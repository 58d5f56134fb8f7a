import pytest
import torch

from connector.groups import GroupSpec
from connector.layout import describe_kv_caches, merge_spans

NB = 16


def test_cpu_layout_one_region_per_layer():
    # vLLM CPU: per layer [num_blocks, kv_heads, block_size, 2*head_size], views of one buffer.
    buf = torch.zeros(2 * NB * 2 * 32 * 64, dtype=torch.bfloat16)
    per_layer = NB * 2 * 32 * 64
    caches = {
        f"layers.{i}": buf[i * per_layer : (i + 1) * per_layer].view(NB, 2, 32, 64)
        for i in range(2)
    }
    mem = describe_kv_caches(caches, NB)
    block = 2 * 32 * 64 * 2
    assert mem.groups[0].layout.base_addrs == (buf.data_ptr(), buf.data_ptr() + NB * block)
    assert mem.groups[0].layout.block_len == block == mem.groups[0].layout.block_stride
    assert mem.groups[0].layout.num_blocks == NB
    # Adjacent regions merge into a single registration span.
    assert mem.spans == ((buf.data_ptr(), 2 * NB * block),)


def test_layers_sharing_one_allocation_count_once():
    t = torch.zeros(NB, 2, 32, 64, dtype=torch.bfloat16)
    mem = describe_kv_caches({"a": t, "b": t.view(NB, 2, 32, 64)}, NB)
    assert mem.groups[0].layout.base_addrs == (t.data_ptr(),)
    assert mem.num_layers == 2


def test_cuda_style_layout_splits_k_and_v():
    # flash-attention: [2, num_blocks, block_size, heads, head] -> K region and V region.
    t = torch.zeros(2, NB, 16, 2, 64, dtype=torch.float16)
    mem = describe_kv_caches({"l0": t}, NB)
    half = NB * 16 * 2 * 64 * 2
    assert mem.groups[0].layout.base_addrs == (t.data_ptr(), t.data_ptr() + half)
    assert mem.groups[0].layout.block_len == 16 * 2 * 64 * 2


def test_strided_blocks_are_described_not_merged():
    # blocks dim not outermost and not packed: [heads, num_blocks, ...] sliced on heads
    full = torch.zeros(NB, 4, 8, dtype=torch.float32)
    view = full[:, :2, :]  # each block is 2*8 floats every 4*8 floats: inner not contiguous? it is
    mem = describe_kv_caches({"l0": view}, NB)
    assert mem.groups[0].layout.block_len == 2 * 8 * 4
    assert mem.groups[0].layout.block_stride == 4 * 8 * 4
    assert not mem.groups[0].layout.blocks_are_packed


def test_non_contiguous_block_refused():
    t = torch.zeros(NB, 8, 4, dtype=torch.float32).transpose(1, 2)
    with pytest.raises(ValueError, match="not contiguous"):
        describe_kv_caches({"l0": t}, NB)


def test_mismatched_layers_refused():
    a = torch.zeros(NB, 2, 8, dtype=torch.float32)
    b = torch.zeros(NB, 4, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="differs from the first layer"):
        describe_kv_caches({"a": a, "b": b}, NB)


def test_no_block_dim_refused():
    with pytest.raises(ValueError, match="no dim of 16 blocks"):
        describe_kv_caches({"a": torch.zeros(3, 4)}, NB)


def test_merge_spans():
    assert merge_spans([(100, 10), (0, 50), (40, 20), (200, 1)]) == ((0, 60), (100, 10), (200, 1))
    assert merge_spans([(0, 10), (10, 10)]) == ((0, 20),)
    assert merge_spans([]) == ()


def test_groups_sharing_one_allocation_use_their_own_layers_only():
    """As on vLLM's CPU backend: a sliding and a full layer share memory; each group
    plans with its own layers' addresses, and the shared bytes are registered once."""
    per_layer = NB * 2 * 32 * 64
    buf = torch.zeros(2 * per_layer, dtype=torch.bfloat16)
    a = buf[:per_layer].view(NB, 2, 32, 64)
    b = buf[per_layer:].view(NB, 2, 32, 64)
    caches = {"l0": a, "l1": a.view(NB, 2, 32, 64), "l2": b, "l3": b.view(NB, 2, 32, 64)}
    groups = (
        GroupSpec("sliding:64", 32, ("l0", "l2")),
        GroupSpec("full", 32, ("l1", "l3")),
    )
    mem = describe_kv_caches(caches, NB, groups)
    assert [g.kind for g in mem.groups] == ["sliding:64", "full"]
    for g in mem.groups:
        assert g.layout.base_addrs == (a.data_ptr(), b.data_ptr())
    assert mem.spans == ((buf.data_ptr(), 2 * per_layer * 2),)
    assert mem.num_regions == 4


def test_groups_with_distinct_layers_get_distinct_regions():
    t = [torch.zeros(NB, 2, 8, dtype=torch.float32) for _ in range(3)]
    caches = {f"l{i}": x for i, x in enumerate(t)}
    groups = (GroupSpec("sliding:64", 16, ("l0", "l2")), GroupSpec("full", 16, ("l1",)))
    mem = describe_kv_caches(caches, NB, groups)
    assert mem.groups[0].layout.base_addrs == (t[0].data_ptr(), t[2].data_ptr())
    assert mem.groups[1].layout.base_addrs == (t[1].data_ptr(),)


def test_group_naming_a_missing_layer_is_refused():
    with pytest.raises(ValueError, match="no KV tensor"):
        describe_kv_caches({"a": torch.zeros(NB, 2)}, NB, (GroupSpec("full", 16, ("b",)),))


def test_layout_mismatch_names_both_sides():
    from connector.layout import GroupLayout, geometry, layout_mismatch
    from connector.plan import RegionLayout

    full = GroupLayout("full", 32, RegionLayout((1, 2), 100, 100, 10))
    sliding = GroupLayout("sliding:64", 32, RegionLayout((1, 2), 100, 100, 10))
    assert layout_mismatch((full,), [geometry(full)]) is None
    # another instance with more memory (more blocks) is fine
    bigger = GroupLayout("full", 32, RegionLayout((7, 8), 100, 100, 99))
    assert layout_mismatch((full,), [geometry(bigger)]) is None
    for other in (
        [geometry(sliding)],  # a different kind of group
        [geometry(full), geometry(full)],  # a different number of groups
        [geometry(GroupLayout("full", 64, full.layout))],  # another block size
        [geometry(GroupLayout("full", 32, RegionLayout((1,), 100, 100, 10)))],  # fewer layers
        [geometry(GroupLayout("full", 32, RegionLayout((1, 2), 50, 50, 10)))],  # other heads
    ):
        msg = layout_mismatch((full,), other)
        assert msg and "prefiller" in msg and "decoder" in msg
