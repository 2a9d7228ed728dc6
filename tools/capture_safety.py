"""Capture safety of the decode step, checked on any device (CPU in CI): what a CUDA graph would
capture (`DecodeRunner._forward` of one bucket, rollout/decode_step.py) must not

- read the host: `.item()`, `.tolist()`, `bool(t)` (aten `_local_scalar_dense`, ops tagged
  `data_dependent_output`): a blocking sync, and a value baked into the graph;
- make a shape from data (ops tagged `dynamic_output_shape`: nonzero, masked_select, unique, ...);
- draw random numbers (ops tagged `nondeterministic_seeded`: a graph replays one draw);
- copy host data to the device (`torch.tensor(...)` inside the region: `lift_fresh`; a CPU tensor
  copied to the device): a graph replays the address, not the host values.

A Triton kernel run by the interpreter (`TRITON_INTERPRET=1`, the decode attention's on CPU) is
traced as one entry per launch, its tensors as what the region reads; the interpreter's own host
copies of those tensors (`.cpu()`, `set_`, `copy_` back), which a compiled kernel never makes, are
not traced. What the Python around the launch does is traced as ever: a planted `.item()` is still
a host read.

Two traces of the same bucket with different inputs must be the same op, shape and argument
sequence (a value read from the inputs into Python would show as a different argument), and the
storages the region reads but did not make (weights, KV cache, RoPE tables, fp32 router copies)
are snapshotted: `DecodeRunner._key()` must change exactly when they do, or a replay would read
freed memory. `tests/unit/megatron_rl/rollout/test_capture_safety.py` runs it (with negative controls) and
tools/gpu_check.sh records it as the row `c: capture safety` (tests/gpu/checks/gpu_decode_checks.py).
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

_HOST_READS = {"_local_scalar_dense", "item", "tolist"}
_H2D = {"_to_copy", "copy_", "to"}


class CaptureTrace(TorchDispatchMode):
    """Every aten op run while active: its trace entry, and the violations of capture safety."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = torch.device(device)
        self.ops: list[tuple] = []
        self.violations: list[str] = []
        self.made: set[int] = set()  # storages the region allocated
        self.read: dict[int, torch.dtype] = {}  # storage address -> dtype, of what the region read from outside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        tags = set(getattr(func, "tags", ()))
        if name in _HOST_READS or torch.Tag.data_dependent_output in tags:
            self.violations.append(f"host read: {name}")
        # index and index_put are tagged for their boolean-mask form only; integer indices keep shapes.
        masked = any(t.dtype in (torch.bool, torch.uint8) for t in tensors[1:])
        if torch.Tag.dynamic_output_shape in tags and (masked or not name.startswith("index")):
            self.violations.append(f"data-dependent shape: {name}")
        # Attention and dropout are tagged for their dropout, which draws only when p > 0.
        if torch.Tag.nondeterministic_seeded in tags and _argument(func, args, kwargs, ("dropout_p", "p"), 1) != 0:
            self.violations.append(f"random numbers: {name}")
        if name in ("lift_fresh", "lift_fresh_copy"):
            self.violations.append(f"host-to-device data: {name} (torch.tensor of host values)")
        if name in _H2D and any(t.device.type == "cpu" for t in tensors) and self.device.type != "cpu":
            self.violations.append(f"host-to-device copy: {name}")
        for t in tensors:
            key = _storage(t)
            if key not in self.made:
                self.read.setdefault(key, t.dtype)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made.add(_storage(t))
        self.ops.append((name, tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors),
                         tuple(repr(a) for a in flat if not isinstance(a, torch.Tensor))))
        return out

    def kernel(self, name: str, args: tuple, kwargs: dict) -> None:
        """One Triton kernel launch: an entry of the trace; its tensors not made here are read."""
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        for t in tensors:
            if _storage(t) not in self.made:
                self.read.setdefault(_storage(t), t.dtype)
        self.ops.append((f"triton:{name}", tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors),
                         tuple(repr(a) for a in flat if not isinstance(a, torch.Tensor))))


@contextlib.contextmanager
def interpreted_launches(trace: CaptureTrace):
    """While inside, each launch of a Triton kernel in the interpreter is `trace.kernel`, and the
    interpreter's own ops are not traced (the module docstring). Without triton, nothing to do."""
    try:
        from triton.runtime.interpreter import GridExecutor  # optional: the CPU wheel of torch has no triton
    except ImportError:
        yield
        return
    launch = GridExecutor.__call__

    def traced(executor, *args, **kwargs):
        trace.kernel(executor.fn.__name__, args, kwargs)
        with _disable_current_modes():
            return launch(executor, *args, **kwargs)

    with mock.patch.object(GridExecutor, "__call__", traced):
        yield


def _argument(func, args, kwargs, names: tuple[str, ...], default):
    """The value of the first of `names` that `func`'s schema has, as called; `default` without one."""
    for i, a in enumerate(func._schema.arguments):
        if a.name in names:
            if a.name in kwargs:
                return kwargs[a.name]
            return args[i] if i < len(args) else a.default_value
    return default


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def trace_bucket(runner, n: int, rows: list[list[int]] | None = None) -> CaptureTrace:
    """Trace what `runner.capture()` records for bucket `n`: its inputs buffer holding `rows`
    (token id, slot, position, tokens so far; default: padding rows), then the padded forward."""
    rows = rows or [runner._pad_row] * n
    runner._host[:n].copy_(torch.tensor(rows))
    if runner._dev is not runner._host:
        runner._dev[:n].copy_(runner._host[:n])
    runner._refresh_copies()
    trace = CaptureTrace(runner.device)
    with torch.inference_mode(), trace, interpreted_launches(trace):
        runner._forward(n, runner.cache.max_len, None, masked=True)
    return trace


def check(engine, seed: int = 0) -> dict:
    """Every bucket of `engine`'s runner: no violation, and two traces with different inputs alike.
    Returns {"ok", "buckets", "violations", "summary"} (the row `c: capture safety`)."""
    runner = engine.runner
    g = torch.Generator().manual_seed(seed)
    vocab, slots, max_len = engine.model.config.vocab_size, engine.cache.slots, engine.cache.max_len
    problems = []
    for n in runner.buckets:
        trace_bucket(runner, n)  # the eager run before each capture: it builds the lazily made tensors
        pad = trace_bucket(runner, n)
        draw = torch.randint(1 << 30, (n, 3), generator=g).tolist()
        real = [[t % vocab, b % slots, p % (max_len - 1), k % max_len] for b, (t, p, k) in enumerate(draw)]
        other = trace_bucket(runner, n, real)
        problems += [f"bucket {n}: {v}" for v in dict.fromkeys(pad.violations + other.violations)]
        if pad.ops != other.ops:
            at = next(i for i, (a, b) in enumerate(zip(pad.ops + [None], other.ops + [None])) if a != b)
            problems.append(f"bucket {n}: the traces of two inputs differ at op {at} "
                            f"({(pad.ops + [None])[at]} vs {(other.ops + [None])[at]}): a value baked into the graph")
    ok = not problems
    return {"ok": ok, "buckets": list(runner.buckets), "violations": problems,
            "summary": f"buckets {runner.buckets}: " + ("no host read, data-dependent shape, RNG or host-to-device "
                                                        "copy; traces alike across inputs" if ok else
                                                        "; ".join(problems[:4]))}


def reads(runner, n: int | None = None) -> set[int]:
    """The storages the captured forward of bucket `n` (default: the largest) reads from outside it,
    after the eager run that precedes a capture (it builds what is built lazily)."""
    trace_bucket(runner, n or runner.buckets[-1])
    return set(trace_bucket(runner, n or runner.buckets[-1]).read)
