"""docker/: the Dockerfiles lint clean and every version they install comes from docker/versions.env.

No Docker engine runs here, so the images are not built; hadolint lints them, and these tests hold
the pinning rule: the Dockerfiles declare their versions as build args without defaults,
docker/build.sh passes every line of versions.env, and every line there is a concrete version.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO

DOCKER = REPO / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))


def _versions() -> dict[str, str]:
    pins = {}
    for n, line in enumerate((DOCKER / "versions.env").read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z][A-Z0-9_]*", key) and value, f"versions.env:{n}: not KEY=VALUE: {line!r}"
        assert key not in pins, f"versions.env:{n}: {key} pinned twice"
        pins[key] = value
    return pins


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: install the dev extras (pip install -e '.[dev]')")
    return path


def test_images_exist():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.h100"]


def test_dockerfiles_lint_clean_with_hadolint():
    res = subprocess.run([_tool("hadolint"), *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_pin_is_a_concrete_version():
    for key, value in _versions().items():
        assert not re.search(r"latest|[*<>~^]|\s", value), f"versions.env: {key}={value} is not a fixed version"
        if key.startswith("BASE_IMAGE"):
            assert re.fullmatch(r"[\w./-]+:[\w.-]+", value), f"{key}={value}: expected IMAGE:TAG"


def test_dockerfiles_take_every_version_from_versions_env():
    pins = _versions()
    used = set()
    for dockerfile in DOCKERFILES:
        steps = _instructions(dockerfile)
        args = [rest for op, rest in steps if op == "ARG"]
        for arg in args:
            assert "=" not in arg, f"{dockerfile.name}: ARG {arg} has a default; pins live in versions.env"
            assert arg in pins, f"{dockerfile.name}: ARG {arg} is not in versions.env"
        used.update(args)
        froms = [rest for op, rest in steps if op == "FROM"]
        assert len(froms) == 1 and re.fullmatch(r"\$\{BASE_IMAGE_\w+\}", froms[0]), froms
        for op, rest in steps:
            if op != "RUN":
                continue
            for cmd in re.split(r"&&|;|\|\|", rest):
                words = cmd.split()
                if words[:2] != ["pip", "install"]:
                    continue
                packages = [w.strip('"') for w in words[2:] if not w.startswith("-") and "://" not in w
                            and not w.startswith('"https')]
                for pkg in packages:
                    if pkg in (".", "/tmp/apex"):  # this checkout; apex at the pinned APEX_REF tag
                        continue
                    assert re.fullmatch(r"[\w.\-\[\]]+==\$\{\w+\}", pkg), f"{dockerfile.name}: unpinned {pkg!r}"
                    used.add(re.search(r"\$\{(\w+)\}", pkg).group(1))
    assert set(pins) <= used, f"versions.env pins nothing uses: {sorted(set(pins) - used)}"


def test_cpu_image_uses_the_torch_of_the_readme_and_ci():
    torch = _versions()["TORCH_CPU_VERSION"]
    for path in (REPO / ".ci" / "run", REPO / "README.md"):
        assert f"torch=={torch}" in path.read_text(), f"{path.name} pins another torch than versions.env"


def test_build_script_passes_every_pin(tmp_path):
    # A stand-in `docker` records the command line docker/build.sh would run.
    fake = tmp_path / "docker"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    fake.chmod(0o755)
    out = tmp_path / "args"
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "ARGS_OUT": str(out)}
    res = subprocess.run(["bash", str(DOCKER / "build.sh"), "h100", "me/flexfloor:1"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    argv = out.read_text().splitlines()
    assert argv[0] == "build" and argv[-1] == str(REPO)
    assert argv[argv.index("-f") + 1] == str(DOCKER / "Dockerfile.h100")
    assert argv[argv.index("-t") + 1] == "me/flexfloor:1"
    passed = [argv[i + 1] for i, a in enumerate(argv) if a == "--build-arg"]
    assert passed == [f"{k}={v}" for k, v in _versions().items()]
    bad = subprocess.run(["bash", str(DOCKER / "build.sh"), "tpu"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 2 and "kinds: h100, cpu" in bad.stderr


def test_export_script_makes_the_enroot_or_apptainer_file(tmp_path):
    """docker/build.sh h100 -> docker/export.sh -> the FF_CONTAINER_IMAGE file the sbatch scripts run."""
    for tool in ("enroot", "apptainer"):  # stand-ins recording their command lines
        (tmp_path / tool).write_text(f'#!/bin/sh\necho {tool} "$@" > "$ARGS_OUT"\n')
        (tmp_path / tool).chmod(0o755)
    out = tmp_path / "args"
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "ARGS_OUT": str(out)}

    def export(*args, expect=0):
        res = subprocess.run(["bash", str(DOCKER / "export.sh"), *args], env=env, capture_output=True, text=True,
                             timeout=30)
        assert res.returncode == expect, res.stderr
        return res.stderr

    export("sqsh", "flexfloor:h100", "/shared/ff.sqsh")
    assert out.read_text().split() == ["enroot", "import", "--output", "/shared/ff.sqsh", "dockerd://flexfloor:h100"]
    export("sif", "flexfloor:h100", "/shared/ff.sif")
    assert out.read_text().split() == ["apptainer", "build", "/shared/ff.sif", "docker-daemon://flexfloor:h100"]
    assert "ends in .sqsh" in export("sqsh", "flexfloor:h100", "/shared/ff.img", expect=2)
    assert "kinds: sqsh, sif" in export("tar", "flexfloor:h100", "x", expect=2)


# Import name of each package of setup.py's `gpu` extra, and what uses it.
GPU_EXTRA_IMPORTS = {"transformer-engine[pytorch]": "transformer_engine", "megatron-core": "megatron.core",
                     "sglang": "sglang"}
# Installed but imported nowhere yet; kept with the reason (docs/cluster.md).
NOT_YET_IMPORTED = {"sglang": "the H100 image's torch pin follows it; see docs/cluster.md"}


def test_every_gpu_dependency_is_imported_somewhere():
    """No dependency that nothing imports (deepspeed was one: removed, docs/cluster.md)."""
    setup = (REPO / "setup.py").read_text()
    extra = re.search(r'"gpu": \[(.*?)\n\s*\],', setup, re.S).group(1)
    packages = [p.split("==")[0] for p in re.findall(r'^\s*"([^"]+)"', extra, re.M)]
    assert set(packages) == set(GPU_EXTRA_IMPORTS), "a new gpu dependency: add it here with its import name"
    code = "\n".join(p.read_text() for d in ("megatron_rl", "elastic", "tools", "tests")
                     for p in (REPO / d).rglob("*.py"))
    for package, module in GPU_EXTRA_IMPORTS.items():
        imported = re.search(rf"^\s*(import|from) {module}\b", code, re.M) is not None
        assert imported or package in NOT_YET_IMPORTED, f"setup.py's gpu extra installs {package}; nothing imports it"
    images = "".join(p.read_text() for p in DOCKERFILES) + (DOCKER / "versions.env").read_text()
    assert "deepspeed" not in images.lower()


def test_gpu_extra_pins_the_h100_images_versions():
    pins = _versions()
    setup = (REPO / "setup.py").read_text()
    gpu = setup[setup.index('"gpu": ['):]
    gpu = gpu[: gpu.index("],")]
    wanted = [("transformer-engine[pytorch]", "TRANSFORMER_ENGINE_VERSION"), ("megatron-core", "MEGATRON_CORE_VERSION")]
    if "SGLANG_VERSION" in pins:  # sglang may leave the image; then it leaves the extra too
        wanted.append(("sglang", "SGLANG_VERSION"))
    for dist, key in wanted:
        assert f'"{dist}=={pins[key]}"' in gpu, f"setup.py gpu extra: {dist} is not pinned to {pins[key]}"
    assert "--no-build-isolation" in setup  # TransformerEngine's install step is documented beside it


def test_h100_image_keeps_te_s_torch_and_checks_its_imports():
    steps = _instructions(DOCKER / "Dockerfile.h100")
    runs = [rest for op, rest in steps if op == "RUN"]
    envs = " ".join(rest for op, rest in steps if op == "ENV")
    assert "FLEXFLOOR_IMAGE=h100" in envs and "FLEXFLOOR_TORCH_VERSION=${TORCH_VERSION}" in envs

    def first(pattern: str) -> int:
        return next(i for i, step in enumerate(steps) if re.search(pattern, step[1]))

    # torch is constrained before anything compiled against it, or able to replace it, is installed.
    constraint = first(r"PIP_CONSTRAINT=/etc/flexfloor-torch-constraint.txt")
    assert first(r"torch==\$\{TORCH_VERSION\}") < first(r"torch==%s") < constraint
    if "SGLANG_VERSION" in _versions():
        assert constraint < first(r"sglang==")
    te = first(r"transformer_engine\[pytorch\]==")
    assert constraint < te and "--no-build-isolation" in steps[te][1]
    assert constraint < first(r"/tmp/apex")
    last = runs[-1]
    assert re.search(r"pip check", last) and re.search(r"python docker/smoke\.py", last)


def test_smoke_test_names_what_does_not_import(tmp_path):
    import sys

    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, str(DOCKER / "smoke.py")], env=env, capture_output=True, text=True,
                         timeout=120)
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001  (no TransformerEngine here: the smoke test must fail, naming it)
        assert res.returncode == 1
        assert res.stderr.strip().startswith("smoke: import transformer_engine.pytorch failed"), res.stderr
    wrong = subprocess.run([sys.executable, str(DOCKER / "smoke.py")], env={**env, "FLEXFLOOR_TORCH_VERSION": "0.0.1"},
                           capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 1 and "replaced the torch 0.0.1" in wrong.stderr


def test_te_image_guard_fails_in_the_image_without_te_and_passes_outside(tmp_path):
    import sys

    guard = REPO / "tools" / "te_image_guard.sh"
    assert subprocess.run([_tool("shellcheck"), str(guard)], capture_output=True, timeout=60).returncode == 0
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    outside = subprocess.run(["bash", str(guard)], env=env, capture_output=True, text=True, timeout=120)
    assert outside.returncode == 0 and "TransformerEngine is optional here" in outside.stdout
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001  (no TransformerEngine here, as in a broken image)
        inside = subprocess.run(["bash", str(guard)], env={**env, "FLEXFLOOR_IMAGE": "h100"}, capture_output=True,
                                text=True, timeout=120)
        assert inside.returncode == 1 and "import transformer_engine.pytorch failed" in inside.stderr
