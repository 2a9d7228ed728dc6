"""The H100 image's import smoke test: TransformerEngine, apex and megatron-core import against the
torch they were built for. Prints one line of versions, or one line naming what is broken and exits 1.

    python docker/smoke.py          # in the image (Dockerfile.h100 runs it at build time, and
                                    # tools/gpu_check.sh runs it first wherever FLEXFLOOR_IMAGE=h100)

`FLEXFLOOR_TORCH_VERSION` (set by Dockerfile.h100 from docker/versions.env) is the torch that
TransformerEngine and apex were compiled against; any other torch means a later install replaced it
and their extensions no longer match. A build has no GPU: Dockerfile.h100 points the loader at the
CUDA driver stub for this check, so only linking and Python-level imports are checked there.
"""
from __future__ import annotations

import os
import sys
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

# (module to import, distribution whose version is reported); apex's CUDA extensions are what the
# fused optimizers and norms load, so import one of them, not just the pure-Python package.
CHECKS = (("transformer_engine.pytorch", "transformer_engine"), ("apex", "apex"), ("amp_C", "apex"),
          ("megatron.core", "megatron-core"))


def main() -> int:
    import torch

    want = os.environ.get("FLEXFLOOR_TORCH_VERSION")
    have = torch.__version__.split("+")[0]
    if want and have != want:
        print(f"smoke: torch {have} replaced the torch {want} TransformerEngine and apex were built for",
              file=sys.stderr)
        return 1
    found = {"torch": torch.__version__}
    for module, dist in CHECKS:
        try:
            import_module(module)
        except Exception as e:  # noqa: BLE001  (a broken extension raises OSError/RuntimeError too)
            first = str(e).splitlines()[0] if str(e) else ""
            print(f"smoke: import {module} failed ({type(e).__name__}: {first})", file=sys.stderr)
            return 1
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = "unknown"
    print("smoke: " + ", ".join(f"{k} {v}" for k, v in found.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
