"""A user error raised inside a spawned rank reaches the driver as one line naming the rank; the
rank that failed of its own is named before the ranks whose collectives reacted to it; a full disk
is `DiskFull` naming the run folder."""
import time

import pytest
import torch
import torch.distributed as dist

from megatron_rl.errors import ConfigError
from megatron_rl.parallel.disk_full import DiskFull
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


def _bug_after_its_peer_reacted(ctx):
    """Rank 1 leaves the world first, so rank 0's all-reduce fails ("Connection closed by peer ...
    GLHF!") and reports well before rank 1's own error: the order a loaded machine produced."""
    if ctx.rank == 1:
        dist.destroy_process_group()
        time.sleep(2.0)
        raise KeyError("a bug")
    dist.all_reduce(torch.ones(1))
    return "ok"


def test_the_cause_is_named_before_a_peers_reaction():
    with pytest.raises(RankFailed) as info:
        run_ranks(_bug_after_its_peer_reacted, 2, timeout_s=60)
    msg = str(info.value)
    assert msg.startswith("rank 1 failed: Traceback") and "KeyError: 'a bug'; rank 0 reported: " in msg, msg


def _disk_full_on_rank_1(ctx):
    if ctx.rank == 1:
        with open("/dev/full", "w") as fh:  # every write: ENOSPC, as on a full disk
            fh.write("a step's metrics\n")
    dist.barrier()
    return "ok"


def test_a_full_disk_on_any_rank_is_disk_full_naming_the_run_folder(tmp_path):
    with pytest.raises(DiskFull) as info:
        run_ranks(_disk_full_on_rank_1, 2, timeout_s=60, writes_to=tmp_path)
    assert str(info.value) == f"no space left on device: {tmp_path}"
