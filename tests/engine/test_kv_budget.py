"""The KV cache's size (`kv_cache.budget.plan_kv_budget`), a pure function: checked against
the arithmetic written out here, without a model."""

from __future__ import annotations

import pytest

from nextoken.kv_cache.budget import KVBudget, default_kv_memory, plan_kv_budget

MiB = 1 << 20


def test_default_budget_is_capped_by_full_contexts():
    """Plenty of memory: no more blocks than max_num_seqs full contexts need."""
    b = plan_kv_budget(block_size=16, bytes_per_block=MiB, max_num_seqs=4, max_model_len=100, available=1 << 40)
    assert b == KVBudget(num_blocks=4 * 7)  # ceil(100 / 16) = 7 blocks per sequence


def test_default_budget_is_capped_by_available_memory():
    b = plan_kv_budget(block_size=16, bytes_per_block=MiB, max_num_seqs=64, max_model_len=8192, available=300 * MiB)
    assert b.num_blocks == 300


def test_explicit_memory_and_block_count():
    """The user's memory wins over the default; an explicit block count wins over both."""
    b = plan_kv_budget(block_size=16, bytes_per_block=MiB, max_num_seqs=1, max_model_len=16, memory_bytes=50 * MiB)
    assert b.num_blocks == 50
    b = plan_kv_budget(block_size=16, bytes_per_block=MiB, max_num_seqs=1, max_model_len=16, memory_bytes=50 * MiB,
                       num_blocks=7)
    assert b.num_blocks == 7
    assert plan_kv_budget(block_size=16, bytes_per_block=MiB, max_num_seqs=1, max_model_len=16,
                          memory_bytes=MiB // 2).num_blocks == 1  # never below one block


def test_sliding_window_rings_come_first():
    """Rings for every sequence when they fit in half the budget, else for as many as do; the
    paged blocks take the rest."""
    kw = dict(block_size=16, bytes_per_block=MiB, max_model_len=1024, ring_blocks=5, bytes_per_ring=10 * MiB)
    b = plan_kv_budget(max_num_seqs=4, memory_bytes=200 * MiB, **kw)
    assert (b.num_rings, b.ring_blocks, b.sliding_blocks) == (4, 5, 20) and b.num_blocks == 200 - 40
    b = plan_kv_budget(max_num_seqs=64, memory_bytes=200 * MiB, **kw)
    assert b.num_rings == 10 and b.num_blocks == 100  # half the budget holds 10 rings
    b = plan_kv_budget(max_num_seqs=64, memory_bytes=5 * MiB, **kw)
    assert b.num_rings == 1  # at least one


def test_every_layer_sliding_needs_no_block_memory():
    """All layers slide (Mistral-style): block tables cost nothing; the count bounds the tokens."""
    b = plan_kv_budget(block_size=16, bytes_per_block=0, max_num_seqs=3, max_model_len=64, ring_blocks=2,
                       bytes_per_ring=MiB, memory_bytes=10 * MiB)
    assert b.num_blocks == 3 * 4 and b.num_rings == 3


def test_bad_sizes_and_the_default_share(tmp_path):
    with pytest.raises(ValueError, match="block_size"):
        plan_kv_budget(block_size=0, bytes_per_block=MiB, max_num_seqs=1, max_model_len=16)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:    4194304 kB\n")  # 4 GiB available
    assert default_kv_memory(str(meminfo)) == 1 << 30  # a quarter, at most 1 GiB
    meminfo.write_text("MemAvailable:    1048576 kB\n")
    assert default_kv_memory(str(meminfo)) == 256 * MiB
    assert default_kv_memory(str(tmp_path / "missing")) == 1 << 30  # 8 GiB assumed
