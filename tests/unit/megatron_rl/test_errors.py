"""One root for input errors, and one way to shorten a value in a message."""
import pytest

from elastic.errors import InputError, shorten
from elastic.planning.dims import LayoutError
from elastic.planning.plan import PlanError
from elastic.trace import TraceError
from megatron_rl.errors import CheckpointError, ConfigError, FlexFloorError


@pytest.mark.parametrize("kind", [TraceError, PlanError, LayoutError, FlexFloorError, ConfigError, CheckpointError])
def test_every_input_error_has_the_one_root(kind):
    assert issubclass(kind, InputError)


def test_elastic_errors_stay_value_errors():
    assert all(issubclass(k, ValueError) for k in (TraceError, PlanError, LayoutError))


def test_shorten_says_how_much_it_cut():
    assert shorten("x" * 250) == "x" * 200 + "... (50 more characters)"
    assert shorten(repr("ab")) == "'ab'" and shorten("ab") == "ab" and shorten([1, 2]) == "[1, 2]"
    assert shorten(ValueError("first\nsecond")) == "first" and shorten(KeyError()) == "KeyError"
