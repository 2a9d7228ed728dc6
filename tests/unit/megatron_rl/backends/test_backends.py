"""The MoE backend objects (megatron_rl/backends): picked by name without torch, and the one dtype rule."""
from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_rl.backends import BACKENDS, backend
from megatron_rl.errors import ConfigError
from tests.helpers import REPO


def test_backends_are_picked_without_importing_torch():
    # Config validation and the pure-Python planner side ask the backend object.
    code = ("import sys; from megatron_rl.backends import BACKENDS, backend; "
            "[backend(n) for n in BACKENDS]; assert 'torch' not in sys.modules, 'torch imported'")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_each_name_gives_its_one_backend_and_its_dtype_rule():
    assert [backend(n).name for n in BACKENDS] == list(BACKENDS)
    assert backend("megatron") is backend("megatron")
    for dtype in ("float32", "float64", "bfloat16"):
        backend("torch").require_dtype(dtype)
    backend("megatron").require_dtype("bfloat16")
    with pytest.raises(ConfigError, match="backend megatron: dtype must be bfloat16 or float32, got float64"):
        backend("megatron").require_dtype("float64")
