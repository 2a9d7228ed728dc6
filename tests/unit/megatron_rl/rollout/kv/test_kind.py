"""The KV kind is decided once, at config load (rollout/kv/kind.py): the config's KV fields checked
in one line each, the kind's cache class, its size on the device, its admission and its planner unit."""
import pytest
import torch

from elastic.planning.memory.kv_unit import PagedUnit, SlotsUnit
from megatron_rl.errors import FlexFloorError
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.kv.cache import KVLayout
from megatron_rl.rollout.kv.kind import PagedKV, SlotsKV, kv_kind
from megatron_rl.rollout.kv.paged import PagedKVCache
from megatron_rl.rollout.kv.slots import SlotKVCache
from megatron_rl.trainer_config import GenerationConfig

LAYOUT = KVLayout(2, 2, 8, torch.float64)


def test_a_config_decides_its_kind_once_and_code_below_asks_it():
    paged = RolloutConfig(kv="paged", kv_page_size=4, kv_pages=12, kv_reserve=0.0).kv_kind
    assert paged == PagedKV(page_size=4, pages=12, reserve=0.0) and paged.predicts
    assert paged.unit == PagedUnit(4)
    slots = GenerationConfig(kv="slots").kv_kind
    assert slots == SlotsKV() and not slots.predicts and slots.unit == SlotsUnit()


def test_each_kind_builds_its_cache_with_its_size():
    slots = SlotsKV().cache(LAYOUT, 6, 40)
    assert type(slots) is SlotKVCache and slots.slots == 6 and slots.shape == (7, 2, 40, 8)
    assert SlotsKV(slots=4).cache(LAYOUT, 6, 40).slots == 4  # fitted to the device: fewer slots
    default = PagedKV(page_size=16).cache(LAYOUT, 6, 40)  # the slots' bytes: 6 x ceil(40 / 16) pages
    assert type(default) is PagedKVCache and default.pool.pages == 18 and default.slots == 6
    assert PagedKV(page_size=16, pages=5).cache(LAYOUT, 6, 40).pool.pages == 5


def test_on_cpu_the_device_leaves_the_configured_size():
    """`within` applies nano-vllm's rule on a GPU only; on CPU every slot (or page) is kept."""
    assert SlotsKV().within(LAYOUT, 6, 40, 0.5) == SlotsKV(slots=6)
    assert PagedKV(page_size=16).within(LAYOUT, 6, 40, 0.5) == PagedKV(page_size=16, pages=18)
    assert PagedKV(page_size=16, pages=5).within(LAYOUT, 6, 40, 0.5).pages == 5  # the config's pool


@pytest.mark.parametrize("fields, message", [
    ({"kv": "blocks"}, "kv: expected one of slots, paged, got 'blocks'"),
    ({"kv": "slots", "kv_pages": 4}, "kv_pages: expected with kv: paged (a pool of pages), got kv: slots"),
    ({"kv": "paged", "kv_pages": 0}, "kv_pages: expected an integer in [1, 2^24], got 0"),
    ({"kv": "paged", "kv_page_size": 0}, "kv_page_size: expected an integer in [1, 2^24], got 0"),
    ({"kv": "paged", "kv_reserve": 1.0}, "kv_reserve: expected in [0, 1), got 1.0"),
])
def test_a_bad_kv_field_is_one_line_naming_it(fields, message):
    with pytest.raises(FlexFloorError) as e:
        RolloutConfig(**fields)
    assert str(e.value) == message


def test_the_trainers_fields_are_named_with_their_section():
    with pytest.raises(FlexFloorError, match=r"^generation\.kv: expected one of slots, paged, got 'pages'$"):
        kv_kind("pages", where="generation.")
