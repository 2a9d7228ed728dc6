"""A user error raised inside a spawned rank reaches the driver as one line naming the rank."""
import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.parallel.launch import RankFailed, run_ranks

pytestmark = pytest.mark.timeout(120)


def _fails_on_rank_1(ctx):
    from elastic.runtime.runtime import ElasticFault

    if ctx.rank == 1:
        try:
            raise ConfigError("batch.trace: line 3: missing field 'response_len'")
        except ConfigError as e:  # the runtime wraps whatever a rank raises, as here
            raise ElasticFault(ctx.rank, 0, "decode", e) from e
    return "ok"


def _bug_on_rank_0(ctx):
    if ctx.rank == 0:
        raise KeyError("a bug")
    return "ok"


def test_wrapped_user_error_is_one_line():
    with pytest.raises(RankFailed) as info:
        run_ranks(_fails_on_rank_1, 2, timeout_s=60)
    msg = str(info.value)
    assert msg == "rank 1 failed: batch.trace: line 3: missing field 'response_len'"


def test_a_bug_keeps_its_traceback():
    with pytest.raises(RankFailed) as info:
        run_ranks(_bug_on_rank_0, 2, timeout_s=60)
    assert "Traceback" in str(info.value) and "KeyError: 'a bug'" in str(info.value)
