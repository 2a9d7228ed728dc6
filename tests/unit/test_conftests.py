"""Test files import helpers from tests/conftest.py as `from conftest import ...`. pytest imports a
conftest.py outside a package as the module `conftest`, replacing the one before it in
`sys.modules`, so a second such file would be what those imports find in any process that collected
it first (an xdist worker that ran a tests/gpu file): every conftest.py below tests/ sits in a package."""
from tests.helpers import REPO


def test_every_nested_conftest_is_in_a_package():
    tests = REPO / "tests"
    bare = [str(c.relative_to(REPO)) for c in tests.rglob("conftest.py")
            if c.parent != tests and not (c.parent / "__init__.py").exists()]
    assert not bare, f"conftest.py outside a package (add an __init__.py beside it): {bare}"
