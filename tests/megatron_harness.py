"""A CPU harness for megatron-core, for tests only: megatron-core's real MoELayer, dispatchers, DDP
and DistributedOptimizer on CPU gloo ranks. The product never imports this file.

megatron-core 0.16.1 calls CUDA directly in a few places that carry no computation; `install()`
patches exactly those, and nothing of megatron-core's own logic (docs/cluster.md, "megatron-core
CPU harness", lists them):
- `torch.cuda.current_device()` -> the CPU device: megatron allocates with
  `device=torch.cuda.current_device()` (router, alltoall output, DDP buffers, optimizer state);
- `torch.cuda.Stream`, `current_stream`, `stream` -> no-op streams: the alltoall dispatcher copies
  its split sizes to the host on a side stream and waits on an event; on CPU the copy is a no-op;
- `device="cuda"` in the tensor factories (`torch.tensor/zeros/empty/ones/full`) of megatron's
  optimizer and gradient-norm modules (`CUDA_FACTORY_MODULES`): their scalars (loss scale one,
  overflow flag, norm accumulators) are made on the CPU instead. Those modules see a `torch` whose
  factories map the device, patched into them as they are imported (a post-import hook, so a
  process that never imports megatron-core pays nothing);
- `Tensor.type()` with no argument names a CPU tensor's CUDA type (`torch.cuda.FloatTensor`):
  the DistributedOptimizer and the gradient clipping sort parameters by comparing those strings
  (the product never calls `.type()`; with an argument it converts, unpatched);
- `megatron_backend.TEST_DEVICE = "cpu"`: the product's one explicit test hook, which lifts its
  refusal of backend megatron without CUDA and builds the layers on the CPU.
Everything else (the split sizes, zero-token steps, the missing `te_general_gemm`, the gloo groups
of the optimizer's save) is the product's own code (megatron_rl/models/megatron_layers.py,
rl/optim/megatron_train.py), tested through this harness.

Spawned ranks are fresh interpreters: `site_env()` puts `tests/megatron_site` (a sitecustomize
that calls `install()`) on PYTHONPATH, so every rank and every `flexfloor` subprocess of a test
runs under the same harness.

Pinned to the megatron-core version setup.py installs (its `gpu` extra; install_requires admits
0.16.x): another version fails loudly here, because the patched call sites are that version's.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import os
import sys
import types
from importlib.metadata import version
from pathlib import Path

import torch

MEGATRON_CORE_VERSION = "0.16.1"
SITE_DIR = Path(__file__).resolve().parent / "megatron_site"


class HarnessVersionError(RuntimeError):
    pass


def check_version() -> None:
    found = version("megatron-core")
    if found != MEGATRON_CORE_VERSION:
        raise HarnessVersionError(
            f"tests/megatron_harness.py patches megatron-core {MEGATRON_CORE_VERSION}'s CUDA call sites; "
            f"megatron-core {found} is installed. Re-check each patched call site in the new version's "
            "source, then update MEGATRON_CORE_VERSION, setup.py's pin and docs/cluster.md together.")


class _NoEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoStream:
    """A CUDA stream on CPU: work is synchronous, so waiting and recording are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _NoEvent:
        return _NoEvent()

    def synchronize(self) -> None:
        pass

    def __eq__(self, other) -> bool:
        return isinstance(other, _NoStream)

    def __hash__(self) -> int:
        return 0


_STREAM = _NoStream()
_installed: list = []

# megatron-core modules that create scalars with a literal device="cuda" (utils: the fallback
# multi-tensor L2 norm without apex or TransformerEngine).
CUDA_FACTORY_MODULES = ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
                        "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.grad_scaler",
                        "megatron.core.utils")
_FACTORIES = ("tensor", "zeros", "empty", "ones", "full")


def _cpu_factory(fn):
    def make(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)
    return make


class _CpuTorch(types.ModuleType):
    """`torch` for a megatron-core module, with the CUDA device of its factories mapped to the CPU."""

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_tensor_type = torch.Tensor.type


def _cuda_type_name(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu":
        return _tensor_type(self).replace("torch.", "torch.cuda.", 1)
    return _tensor_type(self, dtype, non_blocking, **kwargs)


def _patch_module(module) -> None:
    module.torch = _CpuTorch()


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs `_patch_module` on each of CUDA_FACTORY_MODULES right after it executes."""

    def find_spec(self, name, path=None, target=None):
        if name not in CUDA_FACTORY_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch_module(module)
        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Apply the patches in this process (idempotent)."""
    if _installed:
        return
    check_version()
    from megatron_rl.models import megatron_backend

    saved = [(torch.cuda, name, getattr(torch.cuda, name)) for name in ("current_device", "Stream",
                                                                         "current_stream", "stream")]
    saved.append((megatron_backend, "TEST_DEVICE", megatron_backend.TEST_DEVICE))
    saved.append((torch.Tensor, "type", _tensor_type))
    torch.Tensor.type = _cuda_type_name
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.Stream = _NoStream
    torch.cuda.current_stream = lambda device=None: _STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    megatron_backend.TEST_DEVICE = "cpu"
    for name in CUDA_FACTORY_MODULES:
        if name in sys.modules:
            saved.append((sys.modules[name], "torch", torch))
            _patch_module(sys.modules[name])
    finder = _PatchOnImport()
    sys.meta_path.insert(0, finder)
    _installed.extend(saved)
    _installed.append(finder)


def uninstall() -> None:
    """Undo `install` (a module patched on import after it keeps its patch: harmless once
    TEST_DEVICE is None again, as the product then refuses megatron without CUDA)."""
    while _installed:
        item = _installed.pop()
        if isinstance(item, _PatchOnImport):
            sys.meta_path.remove(item)
        else:
            owner, name, value = item
            setattr(owner, name, value)


def site_env(env: dict | None = None) -> dict:
    """`env` (default os.environ) with the harness's sitecustomize first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    repo = str(SITE_DIR.parents[1])
    parts = [str(SITE_DIR), repo] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env
