"""The one preflight of a run (`flexfloor rollout`, `demo`, `train`): what this machine and the
config's files must offer, checked on the driver before any rank starts or any output is written,
so a run that cannot start stops with one line instead of inside W ranks.
"""
from __future__ import annotations

from megatron_rl.backend_rules import backend_rules
from megatron_rl.rl.optim.cpu_adam import require_cpu_adam
from megatron_rl.rollout.leases.jobs import LeaseConfig
from megatron_rl.rollout.leases.sglang import require_sglang


def preflight(backend: str, dtype: str, leases: LeaseConfig, offload: str = "none") -> None:
    """The backend's libraries and device and a dtype it runs (`BackendRules.preflight`), sglang for an
    `sglang` lease, a sidecar's checkpoint headers and queries, and DeepSpeed's CPU Adam for
    `optim.offload: cpu`."""
    backend_rules(backend).preflight(dtype)
    if "sglang" in leases.jobs:
        require_sglang()
    if {"sidecar", "sglang"} & set(leases.jobs):
        leases.sidecar.preflight()
    if offload == "cpu":
        require_cpu_adam()
