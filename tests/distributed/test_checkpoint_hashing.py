"""A rank that cannot read its share of a checkpoint while hashing it: every rank raises the same
one line, none waits in the gather for the failed rank (`rl/checkpoint/checksums.write_checksums`)."""
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def _hash(ctx, folder: str):
    from megatron_rl.errors import CheckpointError
    from megatron_rl.rl.checkpoint import checksums

    path = Path(folder)
    real = checksums._sha256

    def unreadable_on_rank_1(f: Path) -> str:
        if ctx.rank == 1:
            raise PermissionError(13, "Permission denied", str(f))
        return real(f)

    checksums._sha256 = unreadable_on_rank_1
    try:
        checksums.write_checksums(path, ctx.rank)
        said = "no error"
    except CheckpointError as e:
        said = str(e)
    (path.parent / f"rank{ctx.rank}.txt").write_text(said)


def test_a_rank_that_cannot_hash_its_shards_stops_every_rank_with_its_error(tmp_path):
    from megatron_rl.parallel.launch import run_ranks
    from megatron_rl.rl.checkpoint.checksums import CHECKSUMS, SIDECARS

    step = tmp_path / "step_000001"
    step.mkdir()
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", *SIDECARS):
        (step / name).write_bytes(name.encode())
    run_ranks(_hash, 2, str(step), timeout_s=90.0)
    said = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert said[0] == said[1], said
    assert said[0].startswith(f"{step}: cannot hash the checkpoint's files (rank 1: "), said[0]
    assert "Permission denied" in said[0]
    assert not (step / CHECKSUMS).exists()
