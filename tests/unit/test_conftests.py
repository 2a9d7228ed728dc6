"""tests/conftest.py as every test process meets it.

Test files import helpers from it as `from conftest import ...`. pytest imports a conftest.py
outside a package as the module `conftest`, replacing the one before it in `sys.modules`, so a
second such file would be what those imports find in any process that collected it first (an xdist
worker that ran a tests/gpu file): every conftest.py below tests/ sits in a package.

Its time bounds grow with the machine's load, and the pytest of tools/gpu_check.sh (the bare GPU
image's, no plugins) has no pytest-timeout, so no `timeout` ini value: there it scales nothing."""
import conftest

from tests.helpers import REPO


def test_every_nested_conftest_is_in_a_package():
    tests = REPO / "tests"
    bare = [str(c.relative_to(REPO)) for c in tests.rglob("conftest.py")
            if c.parent != tests and not (c.parent / "__init__.py").exists()]
    assert not bare, f"conftest.py outside a package (add an __init__.py beside it): {bare}"


class NoTimeoutPlugin:
    """A pytest config without pytest-timeout: its `timeout` ini value is unknown."""

    def getini(self, name):
        raise ValueError(f"unknown configuration value: {name!r}")


def test_a_loaded_machine_without_pytest_timeout_scales_no_bound(monkeypatch):
    monkeypatch.setattr(conftest, "load_scale", lambda: conftest.MAX_LOAD_SCALE)
    conftest.pytest_collection_modifyitems(NoTimeoutPlugin(), [])  # raised ValueError before
