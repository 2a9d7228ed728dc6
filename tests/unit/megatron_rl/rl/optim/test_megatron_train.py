"""`backend: megatron` in `flexfloor train` and `flexfloor rollout`, on a CPU machine: the one-line
refusals, and everything of the GPU path that is construction (megatron-core's optimizer and DDP
configurations, the training process groups as megatron-core itself checks them, the expert/dense
split, the backend's reinstall of the trained layers after a rollout, the rollout's blocks plan).

The GPU path itself (DDP + DistributedOptimizer stepping, generation through megatron-core's
dispatcher) is tests/gpu/test_megatron_*.py, not yet run on a GPU.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.backends import backend
from megatron_rl.config import ConfigError
from megatron_rl.errors import FlexFloorError
from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from megatron_rl.models.megatron_backend import install_megatron_moe, moe_pg_collection, rebuild_ep
from megatron_rl.trainer_config import GRPOConfig, OptimConfig, TrainerConfig

CPU_BUILD = dict(dispatcher="allgather", dtype=torch.float32, expert_module="SequentialMLP", device="cpu")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_trainer_config_refuses_what_the_megatron_path_cannot_do():
    with pytest.raises(ConfigError, match="backend megatron: expected dtype bfloat16 or float32, got float64"):
        TrainerConfig(backend="megatron", dtype="float64")
    with pytest.raises(ConfigError, match=r"backend megatron: expected grpo.kl_coef 0 .* got 0.1"):
        TrainerConfig(backend="megatron", grpo=GRPOConfig(kl_coef=0.1))
    assert TrainerConfig(backend="megatron", dtype="bfloat16").backend == "megatron"


def test_optimizer_and_ddp_configs_keep_fp32_masters_and_reduce_in_fp32():
    from megatron_rl.rl.optim.megatron_train import ddp_config, optimizer_config, training_config

    o = OptimConfig(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6, grad_clip=0.5)
    oc = optimizer_config(o, torch.bfloat16)
    assert (oc.optimizer, oc.lr, oc.min_lr, oc.weight_decay) == ("adam", 3e-4, 3e-4, 0.1)
    assert (oc.adam_beta1, oc.adam_beta2, oc.adam_eps, oc.clip_grad) == (0.9, 0.95, 1e-6, 0.5)
    assert oc.bf16 and oc.params_dtype == torch.bfloat16 and oc.use_distributed_optimizer
    assert oc.main_params_dtype == oc.main_grads_dtype == oc.exp_avg_dtype == oc.exp_avg_sq_dtype == torch.float32
    assert not optimizer_config(o, torch.float32).bf16
    with pytest.raises(FlexFloorError, match="backend megatron: expected dtype bfloat16 or float32, got float64"):
        backend("megatron").optimizer(None, SimpleNamespace(dtype="float64", model=None, optim=o), 0, 1)
    dc = ddp_config()
    assert dc.grad_reduce_in_fp32 and dc.overlap_grad_reduce and dc.use_distributed_optimizer
    tc = training_config(MoEModelConfig(), 2, torch.bfloat16)
    # Our losses are already divided by the global token count: DDP must sum, not average.
    assert tc.calculate_per_token_loss and not tc.use_cpu_initialization and tc.expert_model_parallel_size == 2


def test_training_groups_pass_megatron_cores_own_checks(one_rank_group):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rl.rl.optim.megatron_train import ddp_config, training_config, training_groups

    pgc = training_groups(0, 1)
    config = training_config(MoEModelConfig(), 1, torch.float32)
    ddp = ProcessGroupCollection.setup_process_groups_for_ddp(pgc, config, ddp_config())
    assert ddp["dp_group"].size() == 1 and ddp["expt_dp_group"] is pgc.expt_dp
    chunk = SimpleNamespace(ddp_config=ddp_config(), config=config)
    groups = ProcessGroupCollection.setup_process_groups_for_optimizer(pgc, [chunk], use_gloo_process_groups=False)
    world = torch.distributed.group.WORLD
    assert groups["dp_cp_group"] is world and groups["intra_dist_opt_group"] is world
    assert groups["intra_expt_dp_group"] is pgc.expt_dp is pgc.tp and groups["mp_group"] is pgc.tp
    assert pgc.ep is world and pgc.dp is world


@no_cuda
def test_megatron_optimizer_and_engine_refuse_a_cpu_model():
    from megatron_rl.rl.optim.megatron_train import MegatronOptimizer
    from megatron_rl.rollout.elastic_engines.megatron_engine import MegatronElasticEngine
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    model = Qwen3MoeModel(MoEModelConfig(), dtype=torch.float32)
    with pytest.raises(FlexFloorError, match="DistributedOptimizer, whose buffers are CUDA tensors"):
        MegatronOptimizer(model, model.config, OptimConfig(), torch.float32, pgc=None)
    with pytest.raises(FlexFloorError, match="the model is not on a CUDA device; run with `device: cuda`"):
        MegatronElasticEngine.on_gpu(RolloutEngine(model, SamplingParams(), 2, 8), 0, 1)


def test_rollout_phase_puts_the_trained_megatron_layers_back(one_rank_group):
    model = Qwen3MoeModel(MoEModelConfig(), dtype=torch.float32)
    model.init_weights(1)
    pgc = moe_pg_collection(one_rank_group, one_rank_group)
    install_megatron_moe(model, pgc, **CPU_BUILD)
    originals = [layer.mlp for layer in model.decoder.layers]
    params = [id(p) for p in model.parameters()]
    rebuild_ep(model, pgc)  # what a shrink and restore leave: new modules ...
    with torch.no_grad():  # ... holding the restored weights
        model.decoder.layers[1].mlp.expert_weights()[3][0].add_(1.0)
    want = model.decoder.layers[1].mlp.expert_weights()[3][0].clone()
    assert model.decoder.layers[0].mlp is not originals[0]
    backend("megatron").restore_experts(model, originals)
    assert [layer.mlp for layer in model.decoder.layers] == originals
    assert [id(p) for p in model.parameters()] == params  # the optimizer's parameters, not copies
    assert torch.equal(originals[1].expert_weights()[3][0], want)


def test_megatron_engine_keeps_layers_already_over_the_group(one_rank_group):
    # Training builds the layers over the world; the rollout's stage 0 is that group: no rebuild.
    from megatron_rl.rollout.elastic_engines.megatron_engine import MegatronElasticEngine
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    model = Qwen3MoeModel(MoEModelConfig(), dtype=torch.float32)
    install_megatron_moe(model, moe_pg_collection(one_rank_group, one_rank_group), **CPU_BUILD)
    layers = [layer.mlp for layer in model.decoder.layers]
    engine = MegatronElasticEngine(RolloutEngine(model, SamplingParams(), 2, 8), 1, one_rank_group, **CPU_BUILD)
    engine.use_group(one_rank_group, dict.fromkeys(range(8), 0))
    assert [layer.mlp for layer in model.decoder.layers] == layers
    engine.drop_expert(7)
    engine.import_expert(7, engine.export_expert(7))
    engine.use_group(one_rank_group, dict.fromkeys(range(8), 0))  # a move happened: rebuilt
    assert model.decoder.layers[0].mlp is not layers[0]


def test_rollout_prepares_a_blocks_plan_for_megatron(monkeypatch):
    # As on a CUDA machine, where require_backend passes.
    from megatron_rl.models import megatron_backend
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout_runner import prepare

    monkeypatch.setattr(megatron_backend, "require_backend", lambda: None)
    with pytest.raises(FlexFloorError, match="backend megatron: expected dtype bfloat16 or float32, got float64"):
        prepare(RolloutConfig(backend="megatron"))
    job = prepare(RolloutConfig(backend="megatron", dtype="float32", policy="planned", floor=1))
    assert job.plan.ownership == "blocks"
    assert all(8 % len(st.members) == 0 for st in job.plan.stages)
    assert prepare(RolloutConfig(dtype="float32", policy="planned", floor=1)).plan.ownership == "balanced"
