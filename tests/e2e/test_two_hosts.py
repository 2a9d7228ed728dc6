"""Two hosts for real (tests/e2e/netns_hosts.py): examples/slurm/launch.sh's launch across two hosts,
with the c10d rendezvous across them.

The rollout is submitted to a real Slurm (slurmctld on host 0, one slurmd per host) where Debian's
slurm-wlm can be installed and started, else the exact line `ff_launch` hands srun on a 2-node
allocation (FLEXFLOOR_DRY_RUN=1, node list ffhost[0-1]) is run on both hosts, as srun would; the
training run and the lost host always take the second way. gloo is pinned to the veth
(GLOO_SOCKET_IFNAME), and the hosts' names resolve to their veth addresses, so the only traffic is
on the veth and each host's loopback.
"""
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import running
from netns_hosts import NetnsUnavailable, TwoHosts
from slurm_cluster import LocalSlurm, SlurmUnavailable, without_gpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
ROLLOUT = {"batch": {"prompts": 8, "samples": 4, "length_scale": 0.01}, "ranks": 4, "policy": "planned",
           "floor": 1, "tailguard": True, "timeout_s": 60.0}


@pytest.fixture(scope="module")
def hosts():
    bed = TwoHosts()
    with running(bed, NetnsUnavailable, "no two-host bed"):
        yield bed
    assert not any(Path("/etc/netns", n).exists() for n in bed.netns)


def launch_line(tmp_path: Path, script: str, *args: str) -> list[str]:
    """What `ff_launch` would run on every node of a 2-node allocation (nodes ffhost0, ffhost1):
    its srun line, less srun and srun's options."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'ffhost0\\nffhost1\\n'\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FLEXFLOOR_DRY_RUN": "1",
           "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "twohosts",
           "SLURM_JOB_NODELIST": "ffhost[0-1]", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_PER_NODE": "",
           "NPROC_PER_NODE": "2", "FF_RUN_DIR": str(tmp_path / "run"), "FF_DEVICE": "cpu",
           "FLEXFLOOR": f"{sys.executable} -m megatron_rl.cli",
           "FF_TORCHRUN": f"{sys.executable} -m torch.distributed.run"}
    out = subprocess.run(["bash", str(ROOT / "examples" / "slurm" / script), *args], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    words = shlex.split(next(line for line in out.splitlines() if line.startswith("flexfloor-slurm: srun ")))[2:]
    while words[0].startswith("--"):
        words.pop(0)
    return words


def host_env(hosts: TwoHosts, host: int) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": hosts.iface}


def on_both(hosts: TwoHosts, argv: list[str], tmp_path: Path) -> list[subprocess.Popen]:
    return [hosts.popen(h, argv, cwd=tmp_path, env=host_env(hosts, h), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True) for h in (0, 1)]


def finish(procs, timeout: float = 300) -> list[tuple[int, str, str]]:
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *o) for p, o in zip(procs, outs)]


def write_config(tmp_path: Path, **changes) -> Path:
    cfg = json.loads(json.dumps(ROLLOUT))
    cfg.update(changes)
    path = tmp_path / f"rollout{len(list(tmp_path.glob('rollout*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def one_host(config: Path, tmp_path: Path) -> dict:
    """The same rollout on 4 ranks of this machine (flexfloor's own launcher, loopback only)."""
    report = tmp_path / "one_host.json"
    subprocess.run([sys.executable, "-m", "megatron_rl.cli", "rollout", "--config", str(config), "--quiet",
                    "--json", str(report)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   capture_output=True, text=True, timeout=300, check=True)
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The test rollout's config, and its report on one host's 4 ranks."""
    tmp = tmp_path_factory.mktemp("one_host")
    config = write_config(tmp)
    return config, one_host(config, tmp)


def slurm_rollout(hosts: TwoHosts, config: Path, tmp_path: Path) -> dict:
    """examples/slurm/rollout.sbatch submitted to a real slurmctld (on host 0) with a slurmd on
    each host, `--nodes=2`: srun starts torchrun on both hosts. Raises SlurmUnavailable."""
    cluster = LocalSlurm(cpus=2, nodes=list(zip(hosts.names, hosts.addresses)), wrap=hosts.argv).start()
    try:
        env = {"FLEXFLOOR_HOME": str(ROOT), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "GLOO_SOCKET_IFNAME": hosts.iface, "NPROC_PER_NODE": "2", "FF_RUN_DIR": str(tmp_path / "run"),
               "FF_DEVICE": "cpu",  # gloo ranks: no GPU is asked for (launch.sh refuses a silent CPU run)
               "FLEXFLOOR": f"{sys.executable} -m megatron_rl.cli",
               "FF_TORCHRUN": f"{sys.executable} -m torch.distributed.run"}
        rc, _ = cluster.sbatch(without_gpus(ROOT / "examples" / "slurm" / "rollout.sbatch", tmp_path), str(config),
                               "--quiet",
                               options=("--nodes=2", "--time=30", f"--output={tmp_path}/%x-%j.out"),
                               cwd=tmp_path, env=env, timeout_s=300)
        log = next(tmp_path.glob("*.out"), None)
        text = log.read_text() if log else ""
        assert rc == 0, text[-3000:] + cluster.logs()
    finally:
        cluster.stop()
    assert "on 2 node(s) x 2 rank(s) per node" in text and "rendezvous ffhost0:" in text, text
    return json.loads((tmp_path / "run" / "report.json").read_text())


def driven_rollout(hosts: TwoHosts, config: Path, tmp_path: Path) -> dict:
    """What srun would run on each node of that allocation, run on both hosts."""
    argv = launch_line(tmp_path, "rollout.sbatch", str(config), "--quiet")
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--rdzv-endpoint=ffhost0:24242" in argv
    for rc, _, err in finish(on_both(hosts, argv, tmp_path)):
        assert rc == 0, err[-3000:]
    return json.loads((tmp_path / "run" / "report.json").read_text())


def test_rollout_across_two_hosts_equals_one_host_and_places_ranks_by_node(hosts, reference, tmp_path):
    """Under a real Slurm where it can be installed and started (one slurmd per host), else
    launch.sh's srun line driven on both hosts; the test prints which ran."""
    from elastic.sim.costmodel import DEFAULT_COST

    config, one = reference
    t0 = time.perf_counter()
    try:
        report, how = slurm_rollout(hosts, config, tmp_path), "under Slurm (slurmctld + a slurmd per host)"
    except SlurmUnavailable as e:
        report, how = driven_rollout(hosts, config, tmp_path), f"launch.sh's srun line driven (no Slurm: {e})"
    print(f"two-host rollout {how}: {time.perf_counter() - t0:.1f} s")
    assert report["responses_sha256"] == one["responses_sha256"]
    assert report["responses"] == 32 and report["final_stage"] > 0, "nothing shrank across the hosts"
    # torchrun gives each host 2 consecutive ranks; ranks_on_this_host is 2, not the world's 4
    hosts_of = report["hosts"]
    assert sorted(hosts_of.values()) == sorted(hosts.names * 2)
    assert hosts_of["0"] == hosts_of["1"] != hosts_of["2"] == hosts_of["3"]
    assert report["ranks_per_node"] == 2
    # The planner's convention (node = rank // ranks_per_node) is where the ranks really are: the
    # cost model prices a move between hosts at the inter-node bandwidth, within one at intra.
    cost = replace(DEFAULT_COST, shape=replace(DEFAULT_COST.shape, ranks_per_node=report["ranks_per_node"]))
    for src in range(4):
        for dst in range(4):
            if src != dst:
                same = hosts_of[str(src)] == hosts_of[str(dst)]
                bw = cost.transfer_intra_bytes_per_s if same else cost.transfer_inter_bytes_per_s
                want = cost.shrink_fixed_s + cost.shape.expert_bytes / bw
                assert cost.transfer_s([(0, src, dst)]) == pytest.approx(want)
    # The staying order keeps a prefix of ranks: every stage of at most 2 ranks is on one host.
    for members in report["stages"]:
        if len(members) <= report["ranks_per_node"]:
            assert len({hosts_of[str(r)] for r in members}) == 1, members


def test_a_host_lost_mid_rollout_ends_the_other_hosts_ranks_and_keeps_finished_responses(hosts, tmp_path):
    config = write_config(tmp_path, policy="vanilla", timeout_s=15.0, batch={**ROLLOUT["batch"], "length_scale": 0.2})
    out = tmp_path / "out"
    argv = launch_line(tmp_path, "rollout.sbatch", str(config), "--quiet", "--out", str(out))
    procs = on_both(hosts, argv, tmp_path)
    deadline = time.monotonic() + 240
    while not any(f.stat().st_size for f in out.glob("responses.rank*.jsonl")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), finish(procs)
        time.sleep(0.2)
    kept_before = {f.name: f.read_text() for f in out.glob("responses.rank*.jsonl")}
    t_kill = time.monotonic()
    assert hosts.kill(1), "no process on host 1"
    rc, stdout, stderr = finish(procs[:1], timeout=120)[0]
    took = time.monotonic() - t_kill
    print(f"host 0 ended {took:.1f} s after host 1 was killed (rc {rc})")
    assert rc != 0 and took < 15.0 + 10, stderr[-3000:]
    # Each of host 0's ranks ends with one line naming its rank, stage and phase; no traceback.
    # (torchrun's --tee prefixes each rank's lines with [defaultN]:)
    lines = [t for t in (re.sub(r"^\[default\d+\]:", "", line) for line in stderr.splitlines())
             if t.startswith("flexfloor")]
    print("\n".join(lines))
    assert sorted(re.match(r"flexfloor rollout: error: rank (\d) failed: rank \1, stage \d+, phase \w+: .+",
                           line).group(1) for line in lines) == ["0", "1"], stderr[-3000:]
    assert "[rank0]: Traceback" not in stderr and "[rank1]: Traceback" not in stderr
    # What finished before the loss is still on disk, line for line.
    for name, text in kept_before.items():
        assert (out / name).read_text().startswith(text)
    assert not (tmp_path / "run" / "report.json").exists()


TRAIN = {
    "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
              "kv_channels": 8, "num_moe_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 16,
              "vocab_size": 20},
    "grpo": {"group_size": 8, "micro_batch": 8},
    "generation": {"max_response_len": 6},
    "elastic": {"policy": "planned", "floor": 2, "shrink_cost_s": 1e-6},
    "checkpoint": {"every": 0, "export_hf": True},
    "logging": {"wandb_mode": "disabled"},
    "steps": 2, "prompts_per_step": 2, "seed": 5, "dtype": "float64", "ranks": 4, "timeout_s": 120.0,
}


def test_train_across_two_hosts_trains_exactly_as_on_one(hosts, tmp_path):
    from safetensors.torch import load_file

    from megatron_rl.data.arith import make_problems, write_jsonl

    write_jsonl(make_problems(8, seed=0, max_operand=4, ops="+"), tmp_path / "arith.jsonl")
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({**TRAIN, "data": {"path": str(tmp_path / "arith.jsonl")}}))
    t0 = time.perf_counter()
    argv = launch_line(tmp_path, "train.sbatch", str(config))
    assert argv[argv.index("train") + 1:argv.index("train") + 6] == \
        ["--device", "cpu", "--config", str(config), "--out"]
    for rc, _, err in finish(on_both(hosts, argv, tmp_path)):
        assert rc == 0, err[-3000:]
    print(f"two-host train: {time.perf_counter() - t0:.1f} s")
    subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(config), "--out",
                    str(tmp_path / "one")], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   capture_output=True, text=True, timeout=300, check=True)
    two, one = tmp_path / "run", tmp_path / "one"
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (two, one)]
    learning = ("reward/", "response_length/", "actor/", "training/")
    assert [{k: v for k, v in r.items() if k.startswith(learning)} for r in rows[0]] == \
        [{k: v for k, v in r.items() if k.startswith(learning)} for r in rows[1]]
    wa, wb = load_file(str(two / "hf" / "model.safetensors")), load_file(str(one / "hf" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)

