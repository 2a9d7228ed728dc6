"""A real one-machine Slurm cluster for tests: munged, slurmctld and slurmd in a temporary folder.

Everything the cluster needs lives under one folder (config, munge key and socket, state, spool,
logs) and uses free ports, so it never touches a system Slurm or munge that may also run on the
machine. The daemons run in the foreground as children of this process, so `stop()` ends exactly
what `start()` began, also after a failure half-way through.

Debian's packages (`slurm-wlm`, `munge`) are installed with apt when missing; `SlurmUnavailable`
carries the reason when that cannot happen (not root, no apt, apt failed), and the test skips
with it.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

# Binary -> Debian package that ships it.
PACKAGES = {"sbatch": "slurm-client", "slurmctld": "slurmctld", "slurmd": "slurmd", "munged": "munge"}
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])
APT_TIMEOUT_S = 600
# Job states after which a job runs no more (a requeued job passes through REQUEUED to PENDING).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}


class SlurmUnavailable(Exception):
    """Slurm cannot be installed or started here; the message is the skip reason."""


def _which(binary: str) -> str | None:
    return shutil.which(binary, path=SEARCH_PATH)


def ensure_installed() -> None:
    """Install Debian's slurm-wlm and munge when a binary is missing (needs root and apt-get)."""
    missing = [b for b in PACKAGES if _which(b) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{', '.join(missing)} not installed and not root, so apt-get cannot install them")
    if _which("apt-get") is None:
        raise SlurmUnavailable(f"{', '.join(missing)} not installed and no apt-get on this machine")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]
    # A clean machine has no package lists yet, so a first failure is retried after an update.
    for attempt in (install, ["apt-get", "update", "-q"], install):
        try:
            res = subprocess.run(attempt, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"`{' '.join(attempt)}` ran past {APT_TIMEOUT_S} s") from None
        if res.returncode == 0 and attempt is install:
            break
    still = [b for b in PACKAGES if _which(b) is None]
    if still:
        tail = (res.stdout + res.stderr).strip().splitlines()[-3:]
        raise SlurmUnavailable(f"apt-get could not install slurm-wlm and munge: {' | '.join(tail)}")


def _free_ports(n: int) -> list[int]:
    """n distinct free ports (all sockets held open while choosing, so none is picked twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _real_memory_mb() -> int:
    """MemTotal in MB, less 5%: slurmd drains a node that advertises more memory than it finds."""
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return max(1, int(kib / 1024 * 0.95))


def without_gpus(script: Path, folder: Path) -> Path:
    """A copy of an example sbatch script less its `--gpus-per-node` line, in `folder`: this cluster
    has no GPUs (the jobs run gloo ranks with FF_DEVICE=cpu), and Slurm refuses a job asking for some."""
    copy = folder / script.name
    copy.write_text(script.read_text().replace("#SBATCH --gpus-per-node=8\n", ""))
    return copy


class LocalSlurm:
    """munged + slurmctld + slurmd on this machine, in a fresh folder under /tmp.

    Not under pytest's tmp_path: that sits in a folder only root may enter, and munged runs as
    the `munge` user. `stop()` removes the folder.
    """

    def __init__(self, cpus: int | None = None, nodes: list[tuple[str, str]] | None = None,
                 wrap: Callable[[int, list[str]], list[str]] | None = None):
        """`nodes`: (name, address) of each node (default: this machine at 127.0.0.1), one slurmd
        each; `wrap(i, argv)` is `argv` run on node i (e.g. in its network namespace:
        tests/e2e/netns_hosts.py). slurmctld and the client commands run on node 0."""
        self.root = Path(tempfile.mkdtemp(prefix="flexfloor-slurm-"))
        self.nodes = nodes or [(socket.gethostname().split(".")[0], "127.0.0.1")]
        self.node = self.nodes[0][0]
        self.wrap = wrap or (lambda i, argv: argv)
        self.cpus = cpus or len(os.sched_getaffinity(0))
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge-run" / "munge.socket"
        self._procs: list[tuple[str, subprocess.Popen]] = []

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm client commands (sbatch, squeue, scontrol) talking to this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf), PATH=SEARCH_PATH)

    # -- start ---------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> LocalSlurm:
        ensure_installed()
        try:
            self._start_munge()
            self._write_conf()
            self._spawn("slurmctld", self.wrap(0, [_which("slurmctld"), "-D", "-f", str(self.conf)]))
            self.wait_until(lambda: self.run(["scontrol", "ping"]).returncode == 0, timeout_s, "slurmctld answering")
            for i, (name, _) in enumerate(self.nodes):
                self._spawn(f"slurmd-{name}", self.wrap(i, [_which("slurmd"), "-D", "-f", str(self.conf), "-N", name]))
            for name, _ in self.nodes:
                self.wait_until(lambda n=name: self.node_state(n) == "idle", timeout_s, f"node {name} idle")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self) -> None:
        # munged refuses a key readable by others and a socket folder that others cannot enter,
        # and runs as the `munge` user the Debian package creates.
        try:
            munge = pwd.getpwnam("munge")
        except KeyError:
            raise SlurmUnavailable("the munge package did not create the `munge` user") from None
        self.root.chmod(0o755)
        key_dir, run_dir = self.root / "munge", self.munge_socket.parent
        key_dir.mkdir(mode=0o700)
        run_dir.mkdir(mode=0o755)
        key = key_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for p in (key_dir, key, run_dir):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        self._spawn("munged", [
            _which("munged"), "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={run_dir / 'munged.pid'}", f"--log-file={key_dir / 'munged.log'}",
            f"--seed-file={key_dir / 'munged.seed'}",
        ], user=munge)
        self.wait_until(self.munge_socket.exists, 20, "munged socket")

    def _write_conf(self) -> None:
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir()
        for name, _ in self.nodes:
            (self.root / "spool" / name).mkdir()
        r = self.root
        (ctld_name, ctld_addr), names = self.nodes[0], ",".join(n for n, _ in self.nodes)
        node_lines = "".join(f"NodeName={n} NodeAddr={a} CPUs={self.cpus} RealMemory={_real_memory_mb()} "
                             "State=UNKNOWN\n" for n, a in self.nodes)
        ctld_port, slurmd_port = _free_ports(2)
        self.conf.write_text(f"""\
# Generated by tests/e2e/slurm_cluster.py: a cluster private to one test session.
ClusterName=flexfloor-test
SlurmctldHost={ctld_name}({ctld_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays the restart of a requeued job; 120 s by default, 5 s is the minimum.
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={r / 'state'}
# One slurmd per node, all on this machine's filesystem: %n is the node's name.
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log'}/slurmd-%n.log
# No cgroups: this also runs inside containers without a writable cgroup tree.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# Start a requeued job as soon as it is eligible, not at the next 60 s scheduling pass.
SchedulerParameters=sched_interval=1
MpiDefault=none
ReturnToService=2
{node_lines}PartitionName=test Nodes={names} Default=YES MaxTime=60 State=UP
""")

    def _spawn(self, name: str, argv: list, user: pwd.struct_passwd | None = None) -> None:
        log = open(self.root / f"{name}.stdout", "wb")
        kwargs = {}
        if user is not None:
            kwargs = dict(user=user.pw_uid, group=user.pw_gid, extra_groups=[])
        proc = subprocess.Popen([str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=self.env, start_new_session=True, **kwargs)
        log.close()
        self._procs.append((name, proc))

    def wait_until(self, ready, timeout_s: float, what: str) -> None:
        """Poll `ready()` until true; fail at once, with the logs, if a daemon dies meanwhile."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self._procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}\n"
                                       + self.logs())
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}\n" + self.logs())

    # -- use -----------------------------------------------------------------------------------
    def run(self, argv: list[str], timeout_s: float = 20, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (output captured, never raises on failure)."""
        return subprocess.run(self.wrap(0, argv), env=kwargs.pop("env", self.env), capture_output=True, text=True,
                              timeout=timeout_s, **kwargs)

    def node_state(self, node: str | None = None) -> str:
        res = self.run(["sinfo", "-h", "-n", node or self.node, "-o", "%T"])
        return res.stdout.strip() if res.returncode == 0 else ""

    def sbatch(self, script: Path, *args: str, options: tuple[str, ...] = (), cwd: Path, env: dict,
               wait: bool = True, timeout_s: float = 180) -> tuple[int, str]:
        """Submit `script args`; with `wait`, block until the job ends. Returns (rc, job id): with
        `wait` the batch script's exit code, as `sbatch --wait` gives it, else sbatch's own. The
        wait polls the job every 0.5 s, where `sbatch --wait` backs off to 10 s between polls (up
        to 10 s lost per job)."""
        argv = ["sbatch", "--parsable", *options, str(script), *args]
        res = self.run(argv, timeout_s=timeout_s, cwd=cwd, env=dict(self.env, **env))
        job_id = res.stdout.strip().split(";")[0].splitlines()[0] if res.stdout.strip() else ""
        if not wait or res.returncode != 0 or not job_id:
            return res.returncode, job_id
        self.wait_until(lambda: self.job_field(job_id, "JobState") in ENDED, timeout_s,
                        f"`{' '.join(argv)}` (job {job_id}) to end")
        code, _, signal_no = self.job_field(job_id, "ExitCode").partition(":")
        return (int(code) or (128 + int(signal_no) if signal_no.isdigit() and int(signal_no) else 0)), job_id

    def job_field(self, job_id: str, field: str) -> str:
        """One field of `scontrol show job` (e.g. JobState, Restarts), '' once the job is forgotten."""
        res = self.run(["scontrol", "-o", "show", "job", job_id])
        for item in res.stdout.split():
            key, _, value = item.partition("=")
            if key == field:
                return value
        return ""

    def logs(self) -> str:
        parts = []
        for path in sorted(self.root.glob("log/*.log")) + sorted(self.root.glob("*.stdout")):
            lines = path.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {path.name} (last lines)\n" + "\n".join(lines))
        return "\n".join(parts)

    # -- stop ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel every job, then end slurmd, slurmctld and munged (in that order), each bounded."""
        if any(name == "slurmctld" and proc.poll() is None for name, proc in self._procs):
            try:
                self.run(["scancel", "--full", "--user", pwd.getpwuid(os.geteuid()).pw_name], timeout_s=10)
                self._wait_no_jobs(15)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for _name, proc in reversed(self._procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
        self._procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def _wait_no_jobs(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            res = self.run(["squeue", "-h", "-o", "%i"], timeout_s=10)
            if res.returncode != 0 or not res.stdout.strip():
                return
            time.sleep(0.5)
