"""The run's KV kind, decided once at config load (`kv_kind`, as the backend and the rollout policy
are) and handed down as an object: code below asks it, and never compares its name.

A kind holds what differs between the two KV caches:
- its cache class, built by `cache` for an engine of `max_batch` sequences of `max_len` positions;
- its byte rule on a device: what one slot (or page) costs and how many of them a device's memory
  gives the cache (`within`, nano-vllm's rule: kv/budget.py);
- its admission: whether the cache admits requests by their predicted lengths (`predicts`: a
  rollout computes those only then; the admission itself is the cache's `admissible`);
- its unit for the planner (`unit`: elastic/planning/memory/kv_unit.py prices a request's KV by it).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import ClassVar

from elastic.planning.memory.kv_unit import KVUnit, PagedUnit, SlotsUnit
from megatron_rl.config import require, require_size
from megatron_rl.rollout.kv.budget import kv_cache_slots, slot_bytes
from megatron_rl.rollout.kv.cache import KVCache, KVLayout
from megatron_rl.rollout.kv.paged import PagedKVCache
from megatron_rl.rollout.kv.slots import SlotKVCache


class KVKind(ABC):
    name: ClassVar[str]
    predicts: ClassVar[bool]  # whether its admission reads each request's predicted length

    @property
    @abstractmethod
    def unit(self) -> KVUnit:
        """How the planner prices a request's KV under this kind."""

    @abstractmethod
    def within(self, layout: KVLayout, max_batch: int, max_len: int, fraction: float) -> KVKind:
        """This kind sized to `fraction` of the memory of `layout.device` (what is in use after the
        weights is taken off), for at most `max_batch` sequences of `max_len` positions."""

    @abstractmethod
    def cache(self, layout: KVLayout, max_batch: int, max_len: int) -> KVCache:
        """The cache of an engine of at most `max_batch` sequences of `max_len` positions."""

    @classmethod
    @abstractmethod
    def configured(cls, page_size: int, pages: int | None, reserve: float, where: str) -> KVKind:
        """The kind of a config's checked KV fields (`kv_kind`); `pages` is checked here."""


@dataclass(frozen=True)
class SlotsKV(KVKind):
    """One slot of `max_len` positions per sequence (kv/slots.py): `slots` of them (None: `max_batch`)."""

    name = "slots"
    predicts = False
    slots: int | None = None

    @property
    def unit(self) -> KVUnit:
        return SlotsUnit()

    def within(self, layout: KVLayout, max_batch: int, max_len: int, fraction: float) -> KVKind:
        per_slot = slot_bytes(layout.num_layers, layout.groups, max_len, layout.channels, layout.dtype)
        return replace(self, slots=kv_cache_slots(layout.device, per_slot, fraction, max_batch))

    def cache(self, layout: KVLayout, max_batch: int, max_len: int) -> KVCache:
        return SlotKVCache(layout, max_batch if self.slots is None else min(max_batch, self.slots), max_len)

    @classmethod
    def configured(cls, page_size: int, pages: int | None, reserve: float, where: str) -> KVKind:
        require(pages is None, f"{where}kv_pages: expected with kv: paged (a pool of pages), got kv: {cls.name}")
        return cls()


@dataclass(frozen=True)
class PagedKV(KVKind):
    """Pages of `page_size` positions (kv/paged.py): `pages` of them (None: as many bytes as the
    slots, `max_batch x ceil(max_len / page_size)` pages), `reserve` of them kept free at admission
    for the sequences that outlive their prediction."""

    name = "paged"
    predicts = True
    page_size: int = 16
    pages: int | None = None
    reserve: float = 0.1

    @property
    def unit(self) -> KVUnit:
        return PagedUnit(self.page_size)

    def within(self, layout: KVLayout, max_batch: int, max_len: int, fraction: float) -> KVKind:
        if self.pages is not None:  # the config's pool
            return self
        per_page = slot_bytes(layout.num_layers, layout.groups, self.page_size, layout.channels, layout.dtype)
        return replace(self, pages=kv_cache_slots(layout.device, per_page, fraction, self._pages(max_batch, max_len)))

    def cache(self, layout: KVLayout, max_batch: int, max_len: int) -> KVCache:
        pages = self._pages(max_batch, max_len) if self.pages is None else self.pages
        return PagedKVCache(layout, max_batch, max_len, pages, self.page_size, self.reserve)

    @classmethod
    def configured(cls, page_size: int, pages: int | None, reserve: float, where: str) -> KVKind:
        if pages is not None:
            require_size(pages, f"{where}kv_pages")
        return cls(page_size, pages, reserve)

    def _pages(self, max_batch: int, max_len: int) -> int:
        return max_batch * math.ceil(max_len / self.page_size)


SLOTS = SlotsKV()
_CACHE_KINDS = {k.name: k for k in (SlotsKV, PagedKV)}
KV_CACHES = tuple(_CACHE_KINDS)  # the engine's caches: the configs' `kv` and bench_engine's --kv


def kv_kind(name: str, page_size: int = 16, pages: int | None = None, reserve: float = 0.1,
            where: str = "") -> KVKind:
    """The kind a config's KV fields name, checked (`where`: their prefix, e.g. `generation.`):
    `kv`, `kv_page_size`, `kv_pages` (a pool of pages: `paged` only) and `kv_reserve`."""
    require(name in _CACHE_KINDS, f"{where}kv: expected one of {', '.join(KV_CACHES)}, got {name!r}")
    require_size(page_size, f"{where}kv_page_size")
    require(0 <= reserve < 1, f"{where}kv_reserve: expected in [0, 1), got {reserve}")
    return _CACHE_KINDS[name].configured(page_size, pages, reserve, where)
