"""The MoE backends: the rules a config checks (megatron_rl/backend_rules.py), picked by name without
torch, with the one dtype rule; the Backend objects (megatron_rl/backends) that ask them; and the
floors: nothing below the backends imports them (they are built once and handed down)."""
from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from megatron_rl.backend_rules import BACKENDS, backend_rules
from megatron_rl.backends import backend
from megatron_rl.errors import ConfigError
from tests.helpers import REPO


def test_rules_are_picked_without_importing_torch():
    # Config validation and the pure-Python planner side ask the rules.
    code = ("import sys; from megatron_rl.backend_rules import BACKENDS, backend_rules; "
            "[backend_rules(n) for n in BACKENDS]; assert 'torch' not in sys.modules, 'torch imported'")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_each_name_gives_its_one_backend_and_its_dtype_rule():
    assert [backend(n).name for n in BACKENDS] == list(BACKENDS)
    assert backend("megatron") is backend("megatron")
    assert all(backend(n).rules is backend_rules(n) for n in BACKENDS)
    for dtype in ("float32", "float64", "bfloat16"):
        backend_rules("torch").require_dtype(dtype)
    backend_rules("megatron").require_dtype("bfloat16")
    with pytest.raises(ConfigError, match="backend megatron: expected dtype bfloat16 or float32, got float64"):
        backend_rules("megatron").require_dtype("float64")
    with pytest.raises(ConfigError, match="backend: expected one of torch, megatron, got 'tpu'"):
        backend("tpu")


def test_nothing_below_the_backends_imports_them():
    # The configs, the rollout and the training parts receive the Backend object; an import of it
    # from there would run back up a floor (the backends build rollout/'s engines and rl/'s optimizers).
    below = [*(REPO / "megatron_rl").glob("rollout/*.py"), *(REPO / "megatron_rl").glob("rl/*.py"),
             *(REPO / "megatron_rl" / n for n in ("config.py", "trainer_config.py", "backend_rules.py"))]
    found = []
    for path in below:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(REPO)}: {n}" for n in names if n.startswith("megatron_rl.backends")]
    assert found == []
