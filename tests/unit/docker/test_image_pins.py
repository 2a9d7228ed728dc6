"""The H100 image's pin set resolves: what docker/Dockerfile.h100 installs, checked without Docker.

pip's own dry-run resolver for another Python and platform downloads whole wheels (hundreds of MB
for sglang's kernels), so this reads each pinned wheel's METADATA instead (`pip download --no-deps`,
a few MB, cached in ~/.cache/flexfloor-image-pins) and holds every requirement on a package against
every exact version of it: the image's pins (docker/versions.env), each wheel's `==` requirements and
setup.py's ranges (`pip install -e .`), as `pip check` at the end of the image's build would. torch,
torchaudio and torchvision come from the PyTorch index and require only CUDA libraries, so they
enter as pins only. Without the package registry the test skips, saying so.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.helpers import REPO

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flexfloor-image-pins"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "linux_x86_64", "any")


def versions() -> dict[str, str]:
    pins = {}
    for line in (REPO / "docker" / "versions.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            pins[key] = value
    return pins


def image_pins(v: dict[str, str]) -> dict[str, str]:
    """Package -> version, as Dockerfile.h100 installs them."""
    return {"torch": v["TORCH_VERSION"], "torchaudio": v["TORCH_VERSION"], "torchvision": v["TORCHVISION_VERSION"],
            "sglang": v["SGLANG_VERSION"], "transformer-engine": v["TRANSFORMER_ENGINE_VERSION"],
            "megatron-core": v["MEGATRON_CORE_VERSION"], "wandb": v["WANDB_VERSION"]}


# The pinned packages whose wheels are read, with the extras the Dockerfile installs.
WHEELS = {"sglang": (), "transformer-engine": ("pytorch",), "megatron-core": (), "wandb": ()}


def setup_requires() -> list[str]:
    """setup.py's install_requires, read without running it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == "install_requires"))


def _wheel(name: str, version: str, python: str) -> Path:
    """The pinned wheel from the cache, downloaded there first when missing; skips without a registry."""
    stem = re.compile(rf"{canonicalize_name(name).replace('-', '_')}-{re.escape(version)}-", re.I)
    found = [p for p in CACHE.glob("*.whl") if stem.match(p.name)]
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                          "--python-version", python, *platforms, "-d", str(CACHE), f"{name}=={version}"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PIP_CONSTRAINT=""))
    found = [p for p in CACHE.glob("*.whl") if stem.match(p.name)]
    if res.returncode == 0 and found:
        return found[0]
    if re.search(r"No matching distribution|Could not find a version", res.stderr):
        pytest.fail(f"{name}=={version}: no wheel for Python {python} on Linux x86_64:\n{res.stderr[-800:]}")
    pytest.skip(f"the package registry cannot be reached to read {name}=={version}'s metadata: "
                f"{(res.stderr.strip().splitlines() or ['(no output)'])[-1]}")


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(zf.read(meta).decode()).get_all("Requires-Dist") or []


def conflicts(v: dict[str, str]) -> list[str]:
    """Every requirement an exact version of the same package breaks, one line each."""
    python = v["PYTHON_H100"]
    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    pins = image_pins(v)
    wanted: list[tuple[str, Requirement]] = [("docker/versions.env", Requirement(f"{n}=={pins[n]}")) for n in pins]
    wanted += [("setup.py", Requirement(r)) for r in setup_requires()]
    for name, extras in WHEELS.items():
        for line in _requires(_wheel(name, pins[name], python)):
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in (*extras, "")):
                wanted.append((f"{name} {pins[name]}", req))
    by_name: dict[str, list[tuple[str, Requirement]]] = {}
    for source, req in wanted:
        by_name.setdefault(canonicalize_name(req.name), []).append((source, req))
    out = []
    for reqs in by_name.values():
        exact = {(s, sp.version) for s, r in reqs for sp in r.specifier if sp.operator == "=="}
        for source, version in sorted(exact):
            for other, req in reqs:
                if other != source and not req.specifier.contains(Version(version), prereleases=True):
                    out.append(f"{source} needs {req.name}=={version}, but {other} requires {req}")
    return out


def test_the_h100_image_pin_set_resolves():
    assert conflicts(versions()) == []


def test_sglang_0_5_9_is_found_to_conflict_with_transformers_5():
    # The pin set of 2026-12-01: sglang 0.5.9 requires transformers==4.57.1, setup.py >=5,<6.
    found = conflicts({**versions(), "SGLANG_VERSION": "0.5.9"})
    assert "sglang 0.5.9 needs transformers==4.57.1, but setup.py requires transformers<6,>=5" in found, found

