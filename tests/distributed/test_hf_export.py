"""The end-of-run HF export written by 4 gloo ranks (each shard by one rank, no
gather of every expert) equals the single-process `flexfloor export` of the same checkpoint, byte
for byte, with shards small enough that experts of every rank land in shards others write."""
import pytest

from megatron_rl.cli import main
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.parallel.launch import run_ranks
from megatron_rl.trainer_config import TrainerConfig

pytestmark = pytest.mark.timeout(240)
SHARD_BYTES = 20_000
CFG = TrainerConfig(model=MoEModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                         kv_channels=8, num_moe_experts=8, moe_router_topk=2,
                                         moe_ffn_hidden_size=16, vocab_size=24),
                    ranks=4, prompts_per_step=4)


def _save_and_export(ctx, out: str) -> None:
    from elastic.trace import Trace
    from megatron_rl.backends import backend
    from megatron_rl.rl.checkpoint.dcp import save_checkpoint
    from megatron_rl.rl.model_setup import export_hf
    from megatron_rl.rl.update.train_step import make_optimizer

    model = backend(CFG.backend).training_model(CFG, ctx.rank, ctx.world)
    state = {"data": {}, "model": CFG.model.to_dict(), "ranks": ctx.world}
    save_checkpoint(out, 1, model, make_optimizer(model, 1e-2), None, state, Trace([], "h"), ctx.rank)
    export_hf(model, CFG.model, f"{out}/hf", ctx.rank, ctx.world, shard_bytes=SHARD_BYTES)


def test_a_four_rank_export_equals_the_single_process_export_byte_for_byte(tmp_path):
    out = tmp_path / "out"
    run_ranks(_save_and_export, 4, str(out), timeout_s=180)
    (out / ".flexfloor.lock").write_text("")
    single_dir = tmp_path / "single"
    assert main(["export", "--out", str(out), "--to", str(single_dir), "--shard-gb", str(SHARD_BYTES / 1e9)]) == 0
    ranks = {p.name: p.read_bytes() for p in (out / "hf").iterdir()}
    single = {p.name: p.read_bytes() for p in single_dir.iterdir()}
    assert len([n for n in ranks if n.endswith(".safetensors")]) >= 6  # experts of all 4 ranks in many shards
    assert ranks.keys() == single.keys() and all(ranks[n] == single[n] for n in ranks), \
        [n for n in ranks if ranks[n] != single.get(n)]
