"""`flexfloor train` as a user runs it: resume, planned == vanilla, metrics files, bad input."""
import json
import subprocess
import sys
from fnmatch import fnmatch
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from conftest import documented_keys, wandb_history, wandb_records

from tests.helpers import REPO as ROOT
from tests.helpers.train import learning, metrics, train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# The offline W&B run files are read back.
_train = partial(train, env={"WANDB_MODE": "offline"})

# Single-digit answers and one-token responses keep a random policy's reward above zero, so every
# step has advantages and real updates.
CONFIG = {
    "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
              "kv_channels": 8, "num_moe_experts": 8, "moe_router_topk": 2,
              "moe_ffn_hidden_size": 16, "vocab_size": 20},
    "grpo": {"group_size": 8, "micro_batch": 8, "tis_cap": 2.0, "kl_coef": 0.05},
    "optim": {"lr": 0.003},
    "generation": {"max_response_len": 3},
    "checkpoint": {"every": 1, "export_hf": True},
    "steps": 3, "prompts_per_step": 4, "seed": 5, "dtype": "float64",
}


def _setup(tmp_path, **changes):
    from megatron_rl.data.arith import make_problems, write_jsonl

    data = tmp_path / "arith.jsonl"
    if not data.exists():
        write_jsonl(make_problems(20, seed=0, max_operand=4, ops="+"), data)
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"] = {"path": str(data)}
    for key, value in changes.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp_path / f"cfg{len(list(tmp_path.glob('cfg*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _weights(out):
    from safetensors.torch import load_file

    return load_file(str(Path(out) / "hf" / "model.safetensors"))


def _same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 3-step run on 2 ranks."""
    tmp = tmp_path_factory.mktemp("straight")
    out = tmp / "out"
    _train(_setup(tmp, **{"logging.plot_every": 2}), out, "--ranks", "2")
    return tmp, out


def test_a_finished_run_refuses_to_rerun_but_a_late_requeue_ends_clean(straight):
    """Rerunning a finished run is a user error (exit 2); a Slurm requeue that came after the last
    step was saved (SLURM_RESTART_COUNT > 0) has nothing to do and must not mark the job failed."""
    import os

    tmp, out = straight
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(tmp / "cfg0.yaml"), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "SLURM_RESTART_COUNT"}
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 2 and "already at step 3 of steps=3; raise `steps`" in again.stderr, again.stderr
    late = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**env, "SLURM_RESTART_COUNT": "1"})
    assert late.returncode == 0 and "the requeued job has nothing left to train" in late.stderr, late.stderr


def test_resume_matches_uninterrupted_run(straight, tmp_path):
    _, full = straight
    cfg = _setup(tmp_path)
    part = tmp_path / "out"
    _train(cfg, part, "--ranks", "2", "--steps", "2")
    proc = _train(cfg, part, "--ranks", "2")
    assert "resuming from" in proc.stderr and "step_000002" in proc.stderr
    a, b = metrics(full), metrics(part)
    assert [m["step"] for m in b] == [1, 2, 3]
    for m_full, m_resumed in zip(a, b):
        assert learning(m_full) == learning(m_resumed)
    assert _same_weights(full, part)
    state = json.loads((part / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["data"]["position"] == 12
    history = (part / "checkpoints" / "step_000003" / "length_history.jsonl").read_text().splitlines()
    assert len(history) == 3 * 4 * 8


def test_async_save_resumes_bit_identically(straight, tmp_path):
    """`checkpoint.async_save`: step 1's save is written while step 2 runs; stopped
    after step 2 and resumed, the run equals the uninterrupted synchronous one, and both saves are
    complete and verified."""
    from megatron_rl.rl.checkpoint.checksums import verify_checksums
    from megatron_rl.rl.checkpoint.dcp import latest_checkpoint

    _, full = straight
    cfg = _setup(tmp_path, **{"checkpoint.async_save": True})
    part = tmp_path / "out"
    _train(cfg, part, "--ranks", "2", "--steps", "2")
    for step in (1, 2):
        verify_checksums(part / "checkpoints" / f"step_{step:06d}")
    assert latest_checkpoint(part) == part / "checkpoints" / "step_000002"
    _train(cfg, part, "--ranks", "2")
    assert [learning(m) for m in metrics(full)] == [learning(m) for m in metrics(part)]
    assert _same_weights(full, part)


def test_bf16_with_masters_resumes_bit_identically(tmp_path):
    """bf16 compute, fp32 masters and AdamW state in the checkpoint, activation recomputation and
    chunked log-probs on: resuming after step 2 gives the uninterrupted run's step 3 and weights."""
    cfg = _setup(tmp_path, dtype="bfloat16", seed=2, recompute_activations=True, logprob_chunk_tokens=5)
    _train(cfg, tmp_path / "full", "--ranks", "2")
    _train(cfg, tmp_path / "part", "--ranks", "2", "--steps", "2")
    _train(cfg, tmp_path / "part", "--ranks", "2")
    a, b = metrics(tmp_path / "full"), metrics(tmp_path / "part")
    assert [learning(m) for m in a] == [learning(m) for m in b]
    assert a[1]["actor/grad_norm"] > 0 and a[2]["actor/grad_norm"] > 0, "no update before and after the resume"
    assert _same_weights(tmp_path / "full", tmp_path / "part")
    assert next(iter(_weights(tmp_path / "full").values())).dtype == torch.bfloat16


def test_metrics_jsonl_and_offline_wandb(straight):
    from megatron_rl.metrics.keys import numeric

    _, out = straight
    rows = metrics(out)
    assert len(rows) == 3
    assert {f"elastic/rank_seconds/{s}" for s in ("busy", "dummy", "transition", "leased", "idle")} <= set(rows[0])
    assert {f"timing_s/{p}" for p in ("gen", "reward", "old_log_prob", "update_actor", "sync", "step")} <= set(rows[0])
    assert rows[0]["actor/lr"] == CONFIG["optim"]["lr"] and rows[0]["actor/entropy"] > 0
    run_file = next((out / "wandb").glob("offline-run-*/run-*.wandb"))
    history = wandb_history(run_file)
    assert [h["trainer/step"] for h in history] == [1, 2, 3]
    media = ("plots/", "rollout/timeline")
    for h, row in zip(history, rows):
        assert {k: v for k, v in h.items() if not k.startswith(("_", *media)) and k != "trainer/step"} == numeric(
            {k: v for k, v in row.items() if k != "step" and not k.startswith(media)})
    # logging.plot_every 2: step 2's timeline, as a file, a W&B image and the segments' table
    assert [r.get("plots/rollout_timeline") for r in rows] == [None, str(out / "timelines" / "step000002.png"), None]
    assert (out / "timelines" / "step000002.png").stat().st_size > 5000
    assert sorted(p.name for p in (out / "timelines").iterdir()) == ["step000002.png"]
    assert history[1]["plots/rollout_timeline/_type"] == "image-file"
    assert history[1]["rollout/timeline/_type"] == "table-file"
    assert not any(k.startswith(media) for k in history[0])
    documented = documented_keys()
    undocumented = [k for k in rows[0] if k != "step" and not any(fnmatch(k, d) for d in documented)]
    assert not undocumented, f"keys missing from docs/training.md's table: {undocumented}"


def test_the_run_records_its_provenance_in_config_checkpoint_and_wandb(straight):
    from megatron_rl.config import load_dataclass
    from megatron_rl.provenance import provenance
    from megatron_rl.trainer_config import TrainerConfig

    _, out = straight
    first = (out / "config.yaml").read_text().splitlines()[0]
    assert first.startswith("# provenance: ") and json.loads(first[len("# provenance: "):]) == provenance()
    assert load_dataclass(TrainerConfig, out / "config.yaml").steps == 3  # still a --config
    assert provenance()["git_sha"] and provenance()["torch"] and provenance()["flexfloor"]
    state = json.loads((out / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert state["provenance"] == provenance()
    run_file = next((out / "wandb").glob("offline-run-*/run-*.wandb"))
    config = {i.key: i.value_json for r in wandb_records(run_file, "run") for i in r.config.update}
    assert json.loads(config["provenance"]) == provenance()


VERL_KEYS = ["critic/score/mean", "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min",
             "actor/pg_loss", "actor/pg_clipfrac", "response_length/mean", "prompt_length/mean",
             "prompt_length/max", "timing_s/gen", "timing_per_token_ms/gen", "timing_per_token_ms/update_actor",
             "perf/throughput", "perf/mfu/actor", "training/global_step"]


def test_verls_metric_names_are_logged_beside_ours(straight):
    rows = metrics(straight[1])
    for row in rows[:2]:
        assert not [k for k in VERL_KEYS if k not in row], sorted(row)
    assert [r["training/global_step"] for r in rows] == [1, 2, 3]
    assert rows[0]["critic/score/mean"] == rows[0]["reward/mean"]
    assert rows[0]["prompt_length/mean"] > 1 and rows[0]["perf/mfu/actor"] == 0.0  # CPU: no peak, no MFU
    assert rows[0]["critic/advantages/min"] <= rows[0]["critic/advantages/mean"] <= rows[0]["critic/advantages/max"]


@pytest.mark.parametrize("policy", ["planned", "adaptive"])
def test_planned_rollout_trains_exactly_like_vanilla(tmp_path, policy):
    # 8 prompts, 4 per step: from step 3 on, the planner has the first epoch's lengths to go by.
    # A random policy's lengths carry no per-prompt signal, so the planner may keep every rank
    # (shrinks and token equality under them are the runtime's tests); the placement does differ.
    # `adaptive` re-plans at every status check (without migration in training).
    cfg = _setup(tmp_path, **{"generation.max_response_len": 8, "checkpoint.every": 0, "steps": 4,
                              "elastic.shrink_cost_s": 1e-6, "data.path": str(_small_data(tmp_path))})
    _train(cfg, tmp_path / "vanilla", "--ranks", "4", "--policy", "vanilla")
    _train(cfg, tmp_path / policy, "--ranks", "4", "--policy", policy, "--floor", "2")
    v, p = metrics(tmp_path / "vanilla"), metrics(tmp_path / policy)
    assert [learning(m) for m in v] == [learning(m) for m in p]
    assert _same_weights(tmp_path / "vanilla", tmp_path / policy)
    assert all(len(m["elastic/stages"]) == 1 for m in v)
    print(policy, "stages, layout per step:", [(m["elastic/stages"], m["elastic/layout"]) for m in p])
    if policy == "adaptive" and all(len(m["elastic/stages"]) == 1 for m in p):
        # Every rank stayed at every step: adaptive's vanilla path is vanilla's own plan.
        assert [(m["elastic/placement"], m["elastic/layout"]) for m in p] == \
            [(m["elastic/placement"], "natural") for m in v]
    else:
        assert any(mv["elastic/placement"] != mp["elastic/placement"] for mv, mp in zip(v, p)), \
            f"{policy} placed every response where vanilla did: the test proves nothing"


def _small_data(tmp_path):
    from megatron_rl.data.arith import make_problems, write_jsonl

    path = tmp_path / "small.jsonl"
    write_jsonl(make_problems(8, seed=1, max_operand=4, ops="+"), path)
    return path


def test_a_resume_into_another_model_shape_fails_clearly(straight, tmp_path):
    _, out = straight
    other = _setup(tmp_path, **{"model.hidden_size": 64, "steps": 5})
    proc = _train(other, out, "--ranks", "2", expect=2)
    assert "checkpoint is for another model shape" in proc.stderr and "hidden_size" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_wandb_after_resume_keeps_the_recomputed_steps(tmp_path):
    """Killed after step 13 with checkpoints every 10, then resumed: W&B keeps the resumed 11-13.

    W&B drops a row whose `_step` is not above the run's last one (online, and when `wandb sync`
    uploads the second offline file into the same run); the view below applies that rule to the
    offline files in the order they were written.
    """
    cfg = _setup(tmp_path, **{"steps": 13, "checkpoint.every": 10, "checkpoint.export_hf": False,
                              "grpo.kl_coef": 0.0})
    out = tmp_path / "out"
    _train(cfg, out, "--ranks", "1")
    # A kill after step 13 but before its checkpoint: the latest complete one is step 10.
    ckpt = out / "checkpoints"
    __import__("shutil").rmtree(ckpt / "step_000013")
    (ckpt / "latest").write_text("step_000010")
    proc = _train(cfg, out, "--ranks", "1")
    assert "step_000010" in proc.stderr
    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and files[0].name == files[1].name  # one W&B run id, two attempts
    kept, last = {}, -1
    for attempt, f in enumerate(files):
        for row in wandb_history(f):
            if row["_step"] > last:
                last = row["_step"]
                kept[row["trainer/step"]] = (attempt, row)
    assert sorted(kept) == list(range(1, 14))
    assert [kept[s][0] for s in (11, 12, 13)] == [1, 1, 1], "W&B would keep the killed run's rows"
    rows = {r["step"]: r for r in metrics(out)}
    assert sorted(rows) == list(range(1, 14))
    for s, (_, row) in kept.items():
        assert row["reward/mean"] == pytest.approx(rows[s]["reward/mean"])
        assert row["actor/lr"] == pytest.approx(rows[s]["actor/lr"])


def _tmpfs_namespace(mountpoint: Path) -> list[str]:
    """A command prefix under which `mountpoint` may get a tmpfs of its own: a private mount namespace
    (root with CAP_SYS_ADMIN), else a user namespace's; the test is skipped where neither is allowed."""
    for prefix in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        probe = subprocess.run([*prefix, "mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(mountpoint)],
                               capture_output=True)
        if probe.returncode == 0:
            return prefix
    pytest.skip("no tmpfs can be mounted here (needs CAP_SYS_ADMIN or user namespaces)")


@pytest.mark.parametrize("async_save", [False, True], ids=["sync_save", "async_save"])
def test_a_full_disk_stops_the_run_with_one_line_and_keeps_the_last_checkpoint(tmp_path, async_save):
    """The run folder on a 420 KiB tmpfs: step 1's checkpoint fits, step 2's does not. The
    synchronous save said `unexpected pos 704 vs 598` (torch's zip writer), exit 2."""
    from tests.tiny_train import tiny_train_config

    cfg = tiny_train_config(tmp_path, steps=2, checkpoint={"every": 1, "export_hf": False,
                                                           "async_save": async_save})
    disk = tmp_path / "disk"
    disk.mkdir()
    prefix = _tmpfs_namespace(disk)
    run = disk / "run"
    script = (f"mount -t tmpfs -o size=420k tmpfs {disk} && "
              f"{sys.executable} -m megatron_rl.cli train --config {cfg} --out {run} logging.wandb_mode=disabled; "
              f"echo rc=$?; echo latest=$(cat {run}/checkpoints/latest)")
    proc = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=500)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("[")]
    assert errors == [f"flexfloor train: error: no space left on device: {run}"], proc.stderr[-3000:]
    assert "rc=1\nlatest=step_000001\n" in proc.stdout, proc.stdout[-2000:]
