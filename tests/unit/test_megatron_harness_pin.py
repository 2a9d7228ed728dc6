"""The megatron-core CPU harness (tests/megatron_harness.py) is pinned to setup.py's megatron-core,
refuses any other version loudly, and is never imported by the product."""
from __future__ import annotations

import re

import megatron_harness
import pytest

from tests.helpers import REPO as ROOT


def test_the_harness_pin_is_setup_pys_megatron_core():
    setup = (ROOT / "setup.py").read_text()
    assert f'"megatron-core=={megatron_harness.MEGATRON_CORE_VERSION}"' in setup  # the gpu extra
    low, high = re.search(r'"megatron-core>=([\d.]+),<([\d.]+)"', setup).groups()
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(low) <= as_tuple(megatron_harness.MEGATRON_CORE_VERSION) < as_tuple(high)


def test_another_megatron_core_version_fails_loudly(monkeypatch):
    monkeypatch.setattr(megatron_harness, "version", lambda name: "0.17.0")
    with pytest.raises(megatron_harness.HarnessVersionError, match="megatron-core 0.17.0 is installed"):
        megatron_harness.check_version()
    with pytest.raises(megatron_harness.HarnessVersionError):
        megatron_harness.install()
    assert not megatron_harness._installed


def test_the_product_never_imports_the_harness():
    for folder in ("megatron_rl", "elastic", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            assert not re.search(r"^\s*(import|from) megatron_harness", path.read_text(), re.M), path
