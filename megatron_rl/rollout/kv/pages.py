"""The page allocator of the paged KV cache: which of a pool's fixed-size pages are free, and how
many block tables hold each of the others.

A page is free (reference count 0, in `free`) or held by one or more sequences: a GRPO group's
samples hold their prompt's full pages together (group prefix sharing), so a page returns to the
free list only when its last holder lets it go. nano-vllm's `BlockManager` keeps the same two
things (`free_block_ids`, `Block.ref_count`); prefix hashing is not needed here, as the engine
knows which requests share a prompt when it admits them.
"""
from __future__ import annotations


class PoolExhausted(RuntimeError):
    """No free page: the engine preempts a request (rollout/scheduler.py), it never drops one."""


class PageAllocator:
    def __init__(self, pages: int):
        if pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {pages}")
        self.pages = pages
        self.refs = [0] * pages
        # pop() hands out the lowest free page first: a run's page ids do not depend on history.
        self.free = list(range(pages - 1, -1, -1))

    @property
    def used(self) -> int:
        return self.pages - len(self.free)

    def alloc(self) -> int:
        if not self.free:
            raise PoolExhausted(f"all {self.pages} KV pages are in use")
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def share(self, page: int) -> int:
        """One more holder of a page in use; returns the page."""
        if self.refs[page] < 1:
            raise RuntimeError(f"KV page {page} is free, it cannot be shared")
        self.refs[page] += 1
        return page

    def release(self, page: int) -> None:
        """One holder fewer; the last one's release frees the page."""
        if self.refs[page] < 1:
            raise RuntimeError(f"KV page {page} released more often than it was held")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free.append(page)
