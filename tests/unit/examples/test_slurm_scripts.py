"""The sbatch scripts' launch commands for multi-node GPU allocations, without a cluster.

tests/e2e/test_slurm.py runs the scripts under a real one-node Slurm; this checks what they would
launch on allocations that machine cannot offer (2 nodes x 8 GPUs, a container image), through
FLEXFLOOR_DRY_RUN=1 and a stand-in `scontrol`, and lints them with shellcheck.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

SLURM_DIR = REPO / "examples" / "slurm"
SCRIPTS = sorted(SLURM_DIR.glob("*.sbatch"))


def _dry_run(tmp_path: Path, script: str, *args: str, expect: int = 0, **env: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    # `scontrol show hostnames gpu[07-08]` expands the node list; the first node hosts the rendezvous.
    scontrol.write_text("#!/bin/sh\nprintf 'gpu07\\ngpu08\\n'\n")
    scontrol.chmod(0o755)
    base = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "FLEXFLOOR_DRY_RUN": "1", "FLEXFLOOR_HOME": str(REPO),
        "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "job",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_PER_NODE": "h100:8",
        "FF_RUN_DIR": str(tmp_path / "run"),
    }
    res = subprocess.run(["bash", str(SLURM_DIR / script), *args], env={**base, **env}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == expect, res.stdout + res.stderr
    return res.stdout + res.stderr


def _launch_line(out: str) -> str:
    lines = [line for line in out.splitlines() if "torchrun" in line]
    assert len(lines) == 1, out
    return lines[0]


def test_scripts_exist():
    assert {p.name for p in SCRIPTS} == {
        "tiny_cpu.sbatch", "rollout.sbatch", "train.sbatch", "qwen3_30b_a3b_16xh100.sbatch"}


def test_multi_node_launch_is_one_torchrun_per_node_meeting_on_the_first_node(tmp_path):
    line = _launch_line(_dry_run(tmp_path, "rollout.sbatch", "cfg.yaml", "--policy", "planned"))
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun" in line
    assert "--nnodes=2 --nproc-per-node=8" in line  # GPUs per node, type prefix stripped
    assert "--rdzv-backend=c10d --rdzv-endpoint=gpu07:24242 --rdzv-id=4242" in line
    assert line.endswith(f"--no-python flexfloor rollout --device cuda --config cfg.yaml --json "
                         f"{tmp_path}/run/report.json --policy planned")


def test_qwen3_example_trains_its_config_into_the_same_folder_after_a_requeue(tmp_path):
    first = _dry_run(tmp_path, "qwen3_30b_a3b_16xh100.sbatch")
    config = REPO / "examples" / "qwen3_30b_a3b_16xh100.yaml"
    assert _launch_line(first).endswith(f"flexfloor train --device cuda --config {config} --out {tmp_path}/run")
    again = _dry_run(tmp_path, "qwen3_30b_a3b_16xh100.sbatch", SLURM_RESTART_COUNT="1")
    # `flexfloor train` resumes from the latest checkpoint of its --out folder by itself.
    assert _launch_line(again) == _launch_line(first)
    assert f"restart 1: flexfloor train resumes from the latest checkpoint in {tmp_path}/run" in again


def test_sbatch_header_asks_for_the_16_gpu_allocation_and_requeue():
    header = [line for line in (SLURM_DIR / "qwen3_30b_a3b_16xh100.sbatch").read_text().splitlines()
              if line.startswith("#SBATCH")]
    for option in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--requeue",
                   "--signal=B:USR1@600"):
        assert f"#SBATCH {option}" in header


MOUNTS = "/lustre/models:/models,/lustre/data:/data"
TORCHRUN = "torchrun --nnodes=2"


def test_pyxis_runs_the_mounted_checkout_in_the_image(tmp_path):
    line = _launch_line(_dry_run(tmp_path, "train.sbatch", "cfg.yaml", SLURM_CPUS_PER_TASK="64",
                                 FF_CONTAINER_IMAGE="registry.example.org#me/flexfloor:h100",
                                 FF_CONTAINER_MOUNTS=MOUNTS))
    assert ("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=64 "
            "--container-image=registry.example.org#me/flexfloor:h100 "
            f"--container-mounts={REPO}:{REPO},{tmp_path}:{tmp_path},{MOUNTS} --container-workdir={tmp_path} "
            f"env PYTHONPATH={REPO} {TORCHRUN}") in line


def test_pyxis_takes_an_enroot_file_and_refuses_a_local_docker_tag(tmp_path):
    sqsh = tmp_path / "flexfloor-h100.sqsh"
    sqsh.write_bytes(b"hsqs")
    line = _launch_line(_dry_run(tmp_path, "train.sbatch", "cfg.yaml", FF_CONTAINER_IMAGE=str(sqsh)))
    assert f"--container-image={sqsh} " in line
    for image, message in (("flexfloor:h100", "looks like a local Docker tag"),
                           (str(tmp_path / "missing.sqsh"), "no such enroot image")):
        res = _dry_run(tmp_path, "train.sbatch", "cfg.yaml", FF_CONTAINER_IMAGE=image, expect=2)
        assert message in res and "torchrun" not in res


def test_apptainer_runs_with_nv_and_the_mounts(tmp_path):
    line = _launch_line(_dry_run(tmp_path, "rollout.sbatch", "cfg.yaml", FF_CONTAINER_RUNTIME="apptainer",
                                 FF_CONTAINER_IMAGE="/shared/flexfloor-h100.sif", FF_CONTAINER_MOUNTS=MOUNTS))
    assert ("--kill-on-bad-exit=1 apptainer exec --nv "
            f"--bind {REPO}:{REPO},{tmp_path}:{tmp_path},{MOUNTS} --pwd {tmp_path} /shared/flexfloor-h100.sif "
            f"env PYTHONPATH={REPO} {TORCHRUN}") in line


def test_docker_runs_on_every_node_with_the_environment_passed_by_name(tmp_path):
    line = _launch_line(_dry_run(tmp_path, "rollout.sbatch", "cfg.yaml", FF_CONTAINER_RUNTIME="docker",
                                 FF_CONTAINER_IMAGE="flexfloor:h100", FF_CONTAINER_MOUNTS=MOUNTS,
                                 NCCL_SOCKET_IFNAME="ib0", WANDB_MODE="offline"))
    assert ("--kill-on-bad-exit=1 docker run --rm --gpus all --ipc=host --network=host --ulimit memlock=-1 "
            f"--workdir {tmp_path} --volume {REPO}:{REPO} --volume {tmp_path}:{tmp_path} "
            "--volume /lustre/models:/models --volume /lustre/data:/data ") in line
    env = line.split(" flexfloor:h100 ")[0] + " "
    for var in ("MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME", "WANDB_MODE", "SLURM_JOB_ID"):
        assert f"--env {var} " in env
    assert f" flexfloor:h100 env PYTHONPATH={REPO} {TORCHRUN}" in line


@pytest.mark.parametrize("env,message", [
    ({"FF_CONTAINER_RUNTIME": "podman"}, "expected one of pyxis apptainer docker"),
    ({"FF_CONTAINER_MOUNTS": "models:/models"}, "FF_CONTAINER_MOUNTS: expected SRC:DST"),
])
def test_bad_container_settings_stop_before_srun(tmp_path, env, message):
    out = _dry_run(tmp_path, "train.sbatch", "cfg.yaml", FF_CONTAINER_IMAGE="r.example.org#me/ff:1", **env,
                   expect=2)
    assert message in out and "torchrun" not in out


def test_the_composed_command_runs(tmp_path):
    """Not a dry run: stand-ins for srun, apptainer and torchrun run what the line says, so its
    quoting holds and the ranks' flexfloor imports the checkout through PYTHONPATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {
        # drop srun's options; drop apptainer's up to the image; drop torchrun's up to --no-python
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"',
        "apptainer": 'shift; while [ "${1#-}" != "$1" ]; do case $1 in --nv) shift;; *) shift 2;; esac; done; '
                     'shift; exec "$@"',
        "torchrun": 'while [ "$1" != --no-python ]; do shift; done; shift; exec "$@"',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    probe = tmp_path / "probe.py"
    probe.write_text("import sys, megatron_rl\nprint('ranks run', megatron_rl.__file__, sys.argv[1:])\n")
    out = _dry_run(tmp_path, "rollout.sbatch", "cfg.yaml", FLEXFLOOR_DRY_RUN="0", FLEXFLOOR=f"{sys.executable} {probe}",
                   FF_CONTAINER_RUNTIME="apptainer", FF_CONTAINER_IMAGE="img.sif", PYTHONPATH="")
    assert f"ranks run {REPO}/megatron_rl/__init__.py ['rollout', '--device', 'cuda', '--config', 'cfg.yaml'" in out


def test_gpu_scripts_ask_for_all_node_memory_and_leave_site_placeholders():
    for name in ("train.sbatch", "rollout.sbatch", "qwen3_30b_a3b_16xh100.sbatch"):
        text = (SLURM_DIR / name).read_text()
        assert "\n#SBATCH --mem=0\n" in text, name
        assert "\n##SBATCH --partition=PARTITION\n" in text and "\n##SBATCH --account=ACCOUNT\n" in text, name
        assert "NCCL_SOCKET_IFNAME" in text and "NCCL_IB_HCA" in text, name


def test_flexfloor_command_may_be_several_words(tmp_path):
    line = _launch_line(_dry_run(tmp_path, "tiny_cpu.sbatch", FLEXFLOOR="python3 -m megatron_rl.cli",
                                 SLURM_JOB_NUM_NODES="1", SLURM_GPUS_PER_NODE=""))
    assert "--nnodes=1 --nproc-per-node=4" in line
    assert "--no-python python3 -m megatron_rl.cli rollout --device cpu --config" in line


def test_a_launcher_path_with_spaces_is_one_word(tmp_path):
    """FLEXFLOOR="/opt/my tools/flexfloor" (and FF_TORCHRUN alike) was split into words by
    `read -r -a`; an executable's path is now taken whole, and the words form above still splits."""
    tools = tmp_path / "my tools"
    tools.mkdir()
    stand_ins = {  # srun drops its options, torchrun its own up to --no-python; flexfloor says what it got
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"',
        "my torchrun": 'while [ "$1" != --no-python ]; do shift; done; shift; exec "$@"',
        "flexfloor": 'printf "flexfloor got:"; printf " [%s]" "$@"; echo',
    }
    for name, body in stand_ins.items():
        f = (tmp_path / "bin" if name == "srun" else tools) / name
        f.parent.mkdir(exist_ok=True)
        f.write_text(f"#!/bin/sh\n{body}\n")
        f.chmod(0o755)
    out = _dry_run(tmp_path, "tiny_cpu.sbatch", FLEXFLOOR_DRY_RUN="0", FLEXFLOOR=str(tools / "flexfloor"),
                   FF_TORCHRUN=str(tools / "my torchrun"), SLURM_JOB_NUM_NODES="1", SLURM_GPUS_PER_NODE="")
    assert "flexfloor got: [rollout] [--device] [cpu] [--config]" in out, out


def test_16xh100_dry_run_starts_8_nccl_ranks_per_node_one_gpu_each(tmp_path):
    out = _dry_run(tmp_path, "qwen3_30b_a3b_16xh100.sbatch")
    assert "on 2 node(s) x 8 rank(s) per node, device cuda (NCCL)" in out
    assert "--nnodes=2 --nproc-per-node=8" in _launch_line(out)


@pytest.mark.parametrize("env, nproc, device", [
    ({"SLURM_GPUS_PER_NODE": "", "SLURM_GPUS_ON_NODE": "4"}, 4, "cuda (NCCL)"),  # --gres=gpu:4
    ({"SLURM_GPUS_PER_NODE": "", "SLURM_GPUS_ON_NODE": "", "FF_DEVICE": "cpu"}, 1, "cpu (gloo)"),
    ({"SLURM_GPUS_PER_NODE": "gpu:h100:8", "SLURM_GPUS_ON_NODE": "2"}, 8, "cuda (NCCL)"),
    ({"FF_DEVICE": "cpu", "NPROC_PER_NODE": "3"}, 3, "cpu (gloo)"),
])
def test_ranks_per_node_and_device_from_the_allocation(tmp_path, env, nproc, device):
    out = _dry_run(tmp_path, "rollout.sbatch", "cfg.yaml", **env)
    assert f"x {nproc} rank(s) per node, device {device}" in out
    assert f"--nproc-per-node={nproc} " in _launch_line(out)
    assert f"rollout --device {device.split()[0]} --config cfg.yaml" in _launch_line(out)


@pytest.mark.parametrize("script", ["train.sbatch", "rollout.sbatch"])
def test_an_allocation_without_gpus_stops_naming_gpus_per_node_unless_cpu_is_asked_for(tmp_path, script):
    out = _dry_run(tmp_path, script, "cfg.yaml", SLURM_GPUS_PER_NODE="", expect=2)
    assert "job 4242 has no GPUs: submit with --gpus-per-node=N" in out and "torchrun" not in out
    assert "device cpu (gloo)" in _dry_run(tmp_path, script, "cfg.yaml", SLURM_GPUS_PER_NODE="", FF_DEVICE="cpu")


def test_gpu_scripts_name_their_gpus_and_their_signal_lead():
    for name in ("train.sbatch", "rollout.sbatch", "qwen3_30b_a3b_16xh100.sbatch"):
        text = (SLURM_DIR / name).read_text()
        assert "\n#SBATCH --gpus-per-node=8\n" in text, name
        signal = re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", text, re.M)
        if name != "rollout.sbatch":  # the trainer plans its last save before that lead
            assert signal and f"\nexport FF_SIGNAL_LEAD_S={signal.group(1)}\n" in text, name


def test_the_run_folder_is_the_job_name_so_a_resubmitted_job_resumes_it(tmp_path):
    lines = [_launch_line(_dry_run(tmp_path, "train.sbatch", "cfg.yaml", FF_RUN_DIR="", SLURM_JOB_ID=job))
             for job in ("4242", "4243")]
    assert lines[0].endswith("--out runs/job") and lines[1].endswith("--out runs/job")


def test_the_stop_grace_comes_from_the_signal_lead_and_reaches_the_container(tmp_path):
    out = _dry_run(tmp_path, "qwen3_30b_a3b_16xh100.sbatch", FF_CONTAINER_RUNTIME="docker",
                   FF_CONTAINER_IMAGE="flexfloor:h100")
    assert "stop grace 540 s after SIGTERM (signal lead 600 s)" in out
    env = _launch_line(out).split(" flexfloor:h100 ")[0] + " "
    for var in ("FF_STOP_GRACE_S", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "FF_SIGNAL_LEAD_S", "FF_RUN_DIR"):
        assert f"--env {var} " in env, var
    assert "--log-dir=" in _launch_line(out) and "--tee=3" in _launch_line(out)  # per-rank log files


def test_tiny_cpu_example_stays_on_gloo_on_a_gpu_node(tmp_path):
    out = _dry_run(tmp_path, "tiny_cpu.sbatch", SLURM_JOB_NUM_NODES="1")
    assert "x 4 rank(s) per node, device cpu (gloo)" in out and "rollout --device cpu" in _launch_line(out)


def test_outside_slurm_the_scripts_say_how_to_submit(tmp_path):
    res = subprocess.run(["bash", str(SLURM_DIR / "rollout.sbatch"), "cfg.yaml"], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin"}, cwd=REPO, timeout=30)
    assert res.returncode != 0 and "submit this script with sbatch" in res.stderr


def _shell_scripts() -> list[Path]:
    """Every shell script git tracks: *.sh, *.sbatch and files starting with a sh/bash shebang.
    Tracked files only, so a virtual environment or other untracked files in the checkout (a
    `.venv/bin/ds_ssh`) are not linted as ours; a new script is checked once it is `git add`ed."""
    listed = subprocess.run(["git", "ls-files", "--cached"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    found = set()
    for path in (REPO / name for name in listed):
        if not path.is_file() or path.suffix in (".py", ".md", ".yaml", ".json", ".jsonl"):
            continue
        if path.suffix in (".sh", ".sbatch"):
            found.add(path)
            continue
        with path.open("rb") as fh:
            first = fh.readline(100)
        if first.startswith(b"#!") and first.rstrip().endswith((b"/sh", b"bash")):
            found.add(path)
    return sorted(found)


def test_every_shell_script_parses_and_passes_shellcheck():
    scripts = _shell_scripts()
    names = {str(p.relative_to(REPO)) for p in scripts}
    assert {"docker/build.sh", "docker/export.sh", "examples/slurm/launch.sh", "examples/slurm/container.sh",
            ".ci/run", "tools/gpu_check.sh"} <= names
    for path in scripts:
        res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, f"bash -n {path}: {res.stderr}"
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck is missing: install the dev extras (pip install -e '.[dev]')")
    res = subprocess.run([shellcheck, "-x", *sorted(names)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
