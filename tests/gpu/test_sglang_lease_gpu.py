"""The sglang lease on a real GPU: start released, serve a lease, hand the memory back.

Skipped without CUDA or sglang (run by tools/gpu_check.sh on the GPU image). NOT YET RUN ON A GPU:
the fake-engine tests (tests/unit/megatron_rl/rollout/leases/test_sglang.py) cover the state machine on CPU.
"""
import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(600),
]


def test_sglang_sidecar_serves_and_gives_its_memory_back(tmp_path):
    pytest.importorskip("sglang")
    from megatron_rl.data.arith import make_problems, write_jsonl
    from megatron_rl.models import Qwen3MoeModel, save_hf_checkpoint
    from megatron_rl.models.config import MoEModelConfig
    from megatron_rl.rollout.leases.sglang import RELEASED, SGLangSidecarJob
    from megatron_rl.rollout.leases.sidecar import SGLangConfig, SidecarConfig

    model = Qwen3MoeModel(MoEModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                         num_query_groups=2, kv_channels=16, num_moe_experts=8,
                                         moe_router_topk=2, moe_ffn_hidden_size=64, vocab_size=32,
                                         max_position_embeddings=64))
    model.init_weights(0)
    save_hf_checkpoint(model, tmp_path / "model", dtype=torch.bfloat16)
    write_jsonl(make_problems(32, seed=0, max_operand=9), tmp_path / "q.jsonl")
    cfg = SidecarConfig(str(tmp_path / "model"), str(tmp_path / "q.jsonl"), max_new_tokens=4, batch=8,
                        sglang=SGLangConfig(mem_fraction_static=0.1, drain_s=1.0))
    job = SGLangSidecarJob(cfg)
    free0 = torch.cuda.mem_get_info()[0]
    job.run(lambda: job.queue.served >= 32)  # the pytest timeout bounds a lease that never gets there
    assert job.state == RELEASED and job.footprint > 0
    assert job.report()["distinct"] == 32
    # The memory is back: what the restore would re-allocate (the engine's whole footprint) fits.
    assert torch.cuda.mem_get_info()[0] >= free0 - cfg.sglang.release_slack_bytes
    block = torch.empty(job.footprint, dtype=torch.uint8, device="cuda")
    del block
