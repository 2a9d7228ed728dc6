"""What code and software a run ran on: git commit, FlexFloor version, torch, megatron-core and
TransformerEngine versions, and the container image when the job ran in one.

Recorded in the run's config.yaml (as comment lines, so the file still loads as a --config), in each
checkpoint's trainer_state.json and in the W&B run's config, so a result can be traced back to the
exact code, also after the checkout moved on.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import subprocess
from pathlib import Path

from megatron_rl import __version__

CHECKOUT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def provenance() -> dict:
    """Name -> value; None where unknown (no git checkout, a package not installed, no container)."""
    import torch  # deferred: the config (and so `flexfloor --help`) imports this module

    sha = _git("rev-parse", "HEAD")
    return {
        "git_sha": sha,
        # Uncommitted changes to tracked files: the sha alone does not describe the code that ran.
        "git_dirty": None if sha is None else bool(_git("status", "--porcelain", "--untracked-files=no")),
        "flexfloor": __version__,
        "torch": torch.__version__,
        "megatron_core": _version("megatron-core"),
        "transformer_engine": _version("transformer-engine") or _version("transformer_engine"),
        # FF_CONTAINER_IMAGE: the image examples/slurm/launch.sh ran the job in; FLEXFLOOR_IMAGE: the
        # kind an image of docker/ says it is (h100, cpu).
        "image": os.environ.get("FF_CONTAINER_IMAGE") or None,
        "image_kind": os.environ.get("FLEXFLOOR_IMAGE") or None,
    }


def provenance_comment() -> str:
    """config.yaml's first line: the provenance as a YAML comment."""
    return f"# provenance: {json.dumps(provenance(), sort_keys=True)}\n"
