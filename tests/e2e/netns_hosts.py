"""Two hosts on one machine for tests: two network namespaces joined by a veth pair.

Each host is a network namespace with loopback and one end of the veth, holding one address of a
private /30 (`ADDRESSES`); nothing else is configured, so a process on a host can reach only its
own loopback and the other host. Each host has its own name (a UTS namespace per process, set
with `hostname`) and an /etc/hosts that names both (bound over /etc/hosts in a mount namespace per
process), so a name resolves to the peer's veth address as on a cluster. Processes share the
machine's filesystem and Python, as cluster nodes share a home folder.

`start()` builds it and `stop()` removes everything `start()` made (the namespaces, their veth and
the /etc/netns folders) and ends every process started on it, also after a failure half-way.
`NetnsUnavailable` carries the reason where the bed cannot be made (not root, no `ip`, namespaces
refused); the tests skip with it. `ip` (Debian's iproute2) is installed with apt when missing.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

ADDRESSES = ("10.250.25.1", "10.250.25.2")  # 10.250.25.0/30, on the veth only
NAMES = ("ffhost0", "ffhost1")
APT_TIMEOUT_S = 300


class NetnsUnavailable(Exception):
    """The two-host bed cannot be made here; the message is the skip reason."""


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def _ensure_ip() -> None:
    missing = "`ip` (iproute2) or `unshare`/`nsenter` (util-linux) missing"
    if shutil.which("ip") and shutil.which("unshare") and shutil.which("nsenter"):
        return
    if os.geteuid() != 0:
        raise NetnsUnavailable(f"{missing} and not root, so apt-get cannot install them")
    if shutil.which("apt-get") is None:
        raise NetnsUnavailable(f"{missing} and no apt-get on this machine")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for attempt in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "iproute2", "util-linux"]):
        subprocess.run(attempt, env=env, capture_output=True, timeout=APT_TIMEOUT_S, check=False)
    if not (shutil.which("ip") and shutil.which("unshare") and shutil.which("nsenter")):
        raise NetnsUnavailable("apt-get could not install iproute2")


class TwoHosts:
    def __init__(self):
        tag = f"ff{os.getpid() % 100000}"
        self.netns = (f"{tag}h0", f"{tag}h1")
        # Each host's end of the veth has the same name, as a cluster's nodes name their network
        # alike (one GLOO_SOCKET_IFNAME for every node); names are per namespace.
        self.iface = "ffveth"
        self.names, self.addresses = NAMES, ADDRESSES
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "TwoHosts":
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        _ensure_ip()
        probe = _run("ip", "netns", "add", self.netns[0])
        if probe.returncode != 0:
            raise NetnsUnavailable(f"`ip netns add` is not allowed here: {probe.stderr.strip()}")
        try:
            self._build()
        except BaseException:
            self.stop()
            raise
        return self

    def _build(self) -> None:
        ns, dev = self.netns, self.iface
        steps = [("ip", "netns", "add", ns[1]),
                 ("ip", "link", "add", dev, "netns", ns[0], "type", "veth", "peer", "name", dev, "netns", ns[1])]
        for i in (0, 1):
            steps += [("ip", "-n", ns[i], "addr", "add", f"{self.addresses[i]}/30", "dev", dev),
                      ("ip", "-n", ns[i], "link", "set", dev, "up"),
                      ("ip", "-n", ns[i], "link", "set", "lo", "up")]
        for argv in steps:
            res = _run(*argv)
            if res.returncode != 0:
                raise NetnsUnavailable(f"`{' '.join(argv)}` failed: {res.stderr.strip()}")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
        for n in ns:
            folder = Path("/etc/netns") / n
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(hosts)
        ping = self.run(1, ["python3", "-c", f"import socket; socket.create_connection(('{self.names[0]}', 9), 2)"])
        if "Connection refused" not in ping.stderr:  # the peer's kernel answered: the link works
            raise NetnsUnavailable(f"the veth pair carries no traffic: {ping.stderr.strip()[-200:]}")

    def argv(self, host: int, argv: list[str]) -> list[str]:
        """`argv` run on `host`: in its network namespace, under its own host name, with its
        /etc/hosts. Not `ip netns exec`, which remounts /sys and so hides the cgroup tree slurmd
        needs; the mount namespace is private, so the bind mount ends with the process."""
        ns = self.netns[host]
        return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "sh", "-c",
                f'hostname "$0" && mount --bind /etc/netns/{ns}/hosts /etc/hosts && exec "$@"',
                self.names[host], *argv]

    def popen(self, host: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on `host`; `stop()` ends it and everything it started there."""
        proc = subprocess.Popen(self.argv(host, argv), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, host: int, argv: list[str], timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(host, argv), capture_output=True, text=True, timeout=timeout, **kwargs)

    def kill(self, host: int) -> list[int]:
        """SIGKILL every process on `host` (all in its network namespace, whatever their process
        group: torchrun starts each rank in a session of its own): the host is gone."""
        pids = [int(p) for p in _run("ip", "netns", "pids", self.netns[host]).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def stop(self) -> None:
        for host in (0, 1):
            self.kill(host)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for n in self.netns:  # deleting a namespace deletes its end of the veth, and so the pair
            _run("ip", "netns", "del", n)
            shutil.rmtree(Path("/etc/netns") / n, ignore_errors=True)
