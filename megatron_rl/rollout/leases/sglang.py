"""The sidecar on a colocated sglang engine (`leases: [sglang]`): GPU only, sglang imported lazily.

Modelled on sglang's RL colocation API, the one verl and slime use to share a GPU between
training and inference: the engine starts with `enable_memory_saver=True`, and
`release_memory_occupation()` / `resume_memory_occupation()` hand its weights and KV cache back to
the device and take them again without restarting the engine (verl's sleep / wake_up).

One engine per rank, in one of four states:

    released --detach, lease starts--> serving --pre-emption--> draining --> releasing --> released

- **released** (from start-up, and between leases): the engine holds no device memory, so the
  rollout's experts and KV cache have the GPU as if no sidecar existed.
- **serving**: `resume_memory_occupation()`, then queries from the sidecar queue (the same queue,
  scoring and counters as the torch sidecar, `megatron_rl/rollout/leases/sidecar.py`).
- **draining** (pre-emption or the lease deadline): nothing more is admitted; running queries get
  `drain_s` to finish, then are aborted and go back to the front of the queue (a restart, never
  a loss).
- **releasing**: `release_memory_occupation()`, and the lease checks the device got the memory
  back before it returns: the restore re-allocates the rollout's KV cache right after, and must
  not fail because of the sidecar.

Memory accounting: a lease resumes only if the device has the engine's footprint free (measured at
its first release) plus `reserve_bytes`; otherwise the lease ends at once (`skipped_no_memory`)
and the rank idles. After the release, free memory must be back within `release_slack_bytes` of
what it was before the resume, or the lease fails (an error the runtime reports, never a restore
that runs out of memory later).
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Callable, Protocol

from megatron_rl.errors import FlexFloorError
from megatron_rl.rollout.engine import Request
from megatron_rl.rollout.leases.sidecar import SidecarConfig, SidecarQueue

RELEASED, SERVING, DRAINING, RELEASING = "released", "serving", "draining", "releasing"


class ServingEngine(Protocol):
    """What the lease needs of an inference engine (sglang's, or a fake in the tests)."""

    def resume(self) -> None: ...

    def release(self) -> None: ...

    def submit(self, input_ids: list[int], max_new_tokens: int) -> Future:
        """Start one greedy generation; the future's result is (output ids, finished: bool)."""

    def abort_all(self) -> None: ...

    def free_bytes(self) -> int: ...


def require_sglang() -> None:
    """The one-line refusal where the sglang lease cannot run (checked before any rank starts)."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        raise FlexFloorError("leases: 'sglang' needs a CUDA GPU (none is visible); use 'sidecar' on CPU")
    if importlib.util.find_spec("sglang") is None:
        raise FlexFloorError("leases: 'sglang' needs the sglang package (see docker/README.md's sidecar "
                             "image); use 'sidecar' for the torch engine")


class SGLangEngine:
    """A colocated `sglang.Engine` driven from its own event-loop thread.

    sglang's Engine runs its tokenizer manager on `engine.loop`; every call here is a coroutine
    scheduled on that loop, run forever by one thread, so the lease thread (which waits, polls and
    aborts) never touches the engine's sockets itself.
    """

    def __init__(self, model_path: str, mem_fraction_static: float, seed: int):
        import sglang  # lazily: GPU images only

        self.engine = sglang.Engine(model_path=model_path, enable_memory_saver=True, skip_tokenizer_init=True,
                                    mem_fraction_static=mem_fraction_static, random_seed=seed)
        self.loop = self.engine.loop
        self.thread = threading.Thread(target=self.loop.run_forever, name="sglang-loop", daemon=True)
        self.thread.start()

    def _call(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def resume(self) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        tm = self.engine.tokenizer_manager
        self._call(tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(), None)).result()

    def release(self) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        tm = self.engine.tokenizer_manager
        flushed = tm.flush_cache()  # a coroutine in recent sglang, a plain call in older releases
        if asyncio.iscoroutine(flushed):
            self._call(flushed).result()
        self._call(tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None)).result()

    def submit(self, input_ids: list[int], max_new_tokens: int) -> Future:
        async def one():
            out = await self.engine.async_generate(
                input_ids=input_ids, sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens})
            reason = (out.get("meta_info", {}).get("finish_reason") or {}).get("type")
            return out.get("output_ids", []), reason != "abort"
        return self._call(one())

    def abort_all(self) -> None:
        self.loop.call_soon_threadsafe(lambda: self.engine.tokenizer_manager.abort_request(abort_all=True))

    def free_bytes(self) -> int:
        import torch

        return torch.cuda.mem_get_info()[0]


class SGLangSidecarJob:
    name = "sglang"

    def __init__(self, cfg: SidecarConfig, rank: int = 0, world: int = 1,
                 engine_factory: Callable[[], ServingEngine] | None = None, poll_s: float = 0.002,
                 repeat: bool = True):
        self.queue = SidecarQueue(cfg, rank, world, repeat)
        self.cfg, self.rank, self.poll_s = cfg, rank, poll_s
        self.factory = engine_factory or (lambda: SGLangEngine(cfg.checkpoint, cfg.sglang.mem_fraction_static, rank))
        self.engine: ServingEngine | None = None
        self.state = RELEASED
        self.footprint = 0  # device bytes the engine holds while serving, measured at its first release
        self.skipped = 0  # leases not taken: the device lacked the engine's footprint

    def done(self) -> bool:
        return self.queue.done()

    def _start(self) -> ServingEngine:
        """Create the engine once, then release it: it starts paused, holding nothing."""
        engine = self.factory()
        before = engine.free_bytes()
        engine.release()
        self.footprint = engine.free_bytes() - before
        return engine

    def run(self, preempted: Callable[[], bool]) -> None:
        if self.engine is None:
            self.engine = self._start()
        engine, q = self.engine, self.queue
        free_before = engine.free_bytes()
        if free_before < self.footprint + self.cfg.sglang.reserve_bytes:
            self.skipped += 1
            return
        self.state = SERVING
        engine.resume()
        running: dict[int, tuple[Request, Future]] = {}
        try:
            while not preempted():
                while len(running) < q.cfg.batch and (r := q.take()) is not None:
                    running[id(r)] = (r, engine.submit(r.prompt, r.max_new_tokens))
                if not running:
                    break
                self._collect(running)
                time.sleep(self.poll_s)
            self.state = DRAINING
            end = time.perf_counter() + self.cfg.sglang.drain_s
            while running and time.perf_counter() < end:
                self._collect(running)
                time.sleep(self.poll_s)
            if running:
                engine.abort_all()
                for _, fut in running.values():
                    try:
                        fut.result(timeout=self.cfg.sglang.drain_s)
                    except Exception:  # noqa: BLE001 - an aborted request may end either way
                        pass
                q.give_back([r for r, _ in running.values()])
        finally:
            self.state = RELEASING
            engine.release()
            self.state = RELEASED
        lost = free_before - engine.free_bytes()
        if lost > self.cfg.sglang.release_slack_bytes:
            raise RuntimeError(f"sglang sidecar kept {lost / 2**20:.0f} MiB after release_memory_occupation; "
                               "the restore's KV cache could not be re-allocated")

    def _collect(self, running: dict[int, tuple[Request, Future]]) -> None:
        for k in [k for k, (_, f) in running.items() if f.done()]:
            r, fut = running.pop(k)
            ids, finished = fut.result()
            if not finished:
                self.queue.give_back([r])
                continue
            r.tokens[:] = ids
            self.queue.tokens += len(ids)
            self.queue.complete(r)

    def report(self) -> dict:
        return {**self.queue.report(), "state": self.state, "skipped_no_memory": self.skipped,
                "footprint_bytes": self.footprint}
