"""The import blocker of `FF_GPU_DRYRUN=1 bash tools/gpu_check.sh`: this process may import only what
the bare H200 holds, so a missing import fails on CPU, not on the lent GPU.

Allowed top-level modules: the standard library, this repository's packages, the bare image's list
(tools/gpu_image.txt) and the modules of the carried wheels present in `$FF_GPU_WHEELS` (matched by
their file names against tools/gpu_wheels.txt; the dry run's Python cannot install cp312 wheels, so
the folder's names stand for them). Every finder of `sys.meta_path` is gated: for any other module it
finds nothing, so `import` raises "No module named ..." and `importlib.util.find_spec` returns None,
as on the image (transformers and megatron-core probe optional packages that way, and an import
guarded by `except ImportError` falls back there and here alike). gpu_check.sh puts this folder first
on PYTHONPATH in dry runs only.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

_TOOLS = Path(__file__).resolve().parents[1]
# tests/ is on sys.path under pytest: its modules, and tests/gpu/ as the package `gpu`.
_REPO = ("megatron_rl", "elastic", "tools", "tests", "conftest", "gpu", "megatron_harness", "megatron_rank_checks",
         "process_tree", "tiny_train", "sitecustomize", "usercustomize")


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "_", dist).lower()


def carried(wheel_dir: str | None) -> set[str]:
    """Modules of the wheels in `wheel_dir` that tools/gpu_wheels.txt names (its pinned version)."""
    names = {_norm(f.name.split("-")[0]) + "-" + f.name.split("-")[1]
             for f in Path(wheel_dir).glob("*.whl")} if wheel_dir and Path(wheel_dir).is_dir() else set()
    out = set()
    for line in (_TOOLS / "gpu_wheels.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req, module = line.split()
            dist, version = req.split("==")
            if f"{_norm(dist)}-{version}" in names:
                out.add(module)
    return out


def allowed(wheel_dir: str | None) -> frozenset[str]:
    image = [w for line in (_TOOLS / "gpu_image.txt").read_text().splitlines() if not line.startswith("#")
             for w in line.split()]
    return frozenset(sys.stdlib_module_names) | set(sys.builtin_module_names) | set(_REPO) | set(image) \
        | carried(wheel_dir)


class Gate:
    """One meta-path finder, finding only modules under an allowed top-level name."""

    def __init__(self, finder, names: frozenset[str]):
        self.finder, self.names = finder, names

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top not in self.names and not top.startswith("_sysconfigdata"):
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(fullname, path, target) if find else None

    def find_distributions(self, *args, **kwargs):
        """Installed metadata, ungated: packages check their dependencies' versions by it
        (latex2sympy2_extended reads antlr4's); what imports is gated above."""
        find = getattr(self.finder, "find_distributions", None)
        return find(*args, **kwargs) if find else iter(())

    def invalidate_caches(self):
        if hasattr(self.finder, "invalidate_caches"):
            self.finder.invalidate_caches()


if os.environ.get("FF_GPU_DRYRUN") == "1":
    _names = allowed(os.environ.get("FF_GPU_WHEELS"))
    sys.meta_path[:] = [Gate(f, _names) for f in sys.meta_path]
