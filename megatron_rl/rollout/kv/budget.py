"""The KV cache's byte rule and its size on a device: what one sequence's keys and values cost,
and how many slots (or pages) a device's memory gives the cache (nano-vllm's rule)."""
from __future__ import annotations

import torch

from megatron_rl.errors import FlexFloorError


def kv_numel(num_layers: int, groups: int, positions: int, channels: int) -> int:
    """Elements of K and V of `positions` positions of one sequence in every layer: the one KV
    formula (slots, pages, the memory budget's bytes per token, a migrated request's rows)."""
    return num_layers * 2 * groups * positions * channels


def slot_bytes(num_layers: int, groups: int, max_len: int, channels: int, dtype: torch.dtype) -> int:
    """K and V of one sequence of `max_len` positions in every layer."""
    return kv_numel(num_layers, groups, max_len, channels) * dtype.itemsize


def kv_budget_slots(total: int, free: int, peak: int, current: int, fraction: float, per_slot: int,
                    max_slots: int) -> int:
    """nano-vllm's rule: the cache may take `fraction` of the device's `total` bytes, less what is
    in use (`total - free`: every process's memory, our weights included) and less this process's
    activation peak above its current allocation (`peak - current`, from a warm-up if one ran);
    at most `max_slots` slots, besides the scratch slot. Fewer than one slot is an error naming the numbers."""
    budget = int(total * fraction) - (total - free) - max(0, peak - current)
    # One slot more than the requests' is allocated: the scratch slot of padded decode rows.
    slots = min(max_slots, max(0, budget) // per_slot - 1)
    if slots < 1:
        gib = 2**30
        raise FlexFloorError(
            f"kv_memory_fraction {fraction}: the KV cache gets {max(0, budget) / gib:.2f} GiB of the device's "
            f"{total / gib:.1f} GiB ({(total - free) / gib:.1f} GiB in use), one sequence needs "
            f"{per_slot / gib:.3f} GiB; raise kv_memory_fraction, shorten responses or use more ranks")
    return slots


def kv_cache_slots(device: torch.device, per_slot: int, fraction: float, max_slots: int) -> int:
    """Slots for this rank's cache, measured on `device` after the weights are loaded."""
    if device.type != "cuda":
        return max_slots
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    return kv_budget_slots(total, free, stats.get("allocated_bytes.all.peak", 0),
                           stats.get("allocated_bytes.all.current", 0), fraction, per_slot, max_slots)
