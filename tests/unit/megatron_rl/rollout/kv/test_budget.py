"""The KV cache is sized from the device's memory and freed by a detached rank (CPU-testable parts)."""
import pytest
import torch

from megatron_rl.errors import FlexFloorError
from megatron_rl.rollout.kv.budget import kv_budget_slots, kv_cache_slots, slot_bytes
from megatron_rl.rollout.kv.cache import KVLayout
from megatron_rl.rollout.kv.slots import SlotKVCache

GIB = 2**30


def test_slot_bytes_of_qwen3_30b_is_96_kib_per_token():
    # 48 layers x K,V x 4 KV heads x 128 x 2 B (bf16) = 96 KiB per token (docs: REFERENCES).
    assert slot_bytes(48, 4, 1, 128, torch.bfloat16) == 96 * 1024
    assert slot_bytes(48, 4, 8192, 128, torch.bfloat16) == 96 * 1024 * 8192


def test_budget_is_fraction_of_total_less_memory_in_use_and_activation_peak():
    per = slot_bytes(48, 4, 8192, 128, torch.bfloat16)  # 0.75 GiB
    # 80 GiB device, 12 GiB in use (weights), no warm-up peak: 0.9 x 80 - 12 = 60 GiB -> 80 slots,
    # one of them the scratch slot of padded decode rows.
    assert kv_budget_slots(80 * GIB, 68 * GIB, 0, 0, 0.9, per, 1000) == 79
    # A 4 GiB activation peak above the current allocation comes off the budget too.
    assert kv_budget_slots(80 * GIB, 68 * GIB, 10 * GIB, 6 * GIB, 0.9, per, 1000) == 73
    # Another process on the GPU (a sidecar) shrinks it the same way.
    assert kv_budget_slots(80 * GIB, 38 * GIB, 0, 0, 0.9, per, 1000) == 39
    assert kv_budget_slots(80 * GIB, 68 * GIB, 0, 0, 0.9, per, 64) == 64  # capped at max_batch_per_rank


def test_no_room_for_one_sequence_names_the_field_and_numbers():
    with pytest.raises(FlexFloorError, match=r"kv_memory_fraction 0.5: the KV cache gets 0.00 GiB of the device's "
                                             r"80.0 GiB \(50.0 GiB in use\)"):
        kv_budget_slots(80 * GIB, 30 * GIB, 0, 0, 0.5, GIB, 64)


def test_cpu_keeps_the_configured_slots():
    assert kv_cache_slots(torch.device("cpu"), 10**15, 0.1, 64) == 64


def test_detached_cache_frees_its_bytes_and_reallocates_zeroed():
    cache = SlotKVCache(KVLayout(2, 2, 8, torch.float64), 4, 16)  # 4 slots and the scratch slot
    assert cache.nbytes == 2 * 2 * 5 * 2 * 16 * 8 * 8
    s = cache.alloc()
    with pytest.raises(RuntimeError, match="1 live sequences"):
        cache.release_memory()
    cache.k[0].fill_(1.0)
    cache.release(s)
    assert cache.release_memory() == 2 * 2 * 5 * 2 * 16 * 8 * 8 and cache.nbytes == 0 and cache.k == []
    cache.reclaim_memory()
    assert cache.nbytes == 2 * 2 * 5 * 2 * 16 * 8 * 8 and all(int(t.count_nonzero()) == 0 for t in cache.k)
