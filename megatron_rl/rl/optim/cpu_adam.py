"""DeepSpeed's CPU Adam for `optim.offload: cpu` (rl/optim/zero.py steps its host-resident shard with it):
the driver's check that it builds, the optimizer itself, and its state in torch AdamW's form.

`deepspeed.ops.adam.DeepSpeedCPUAdam` is a fused AVX Adam, JIT-built once into
~/.cache/torch_extensions. It keeps a parameter's step as an int, where torch AdamW keeps a float32
tensor, and its bias corrections in C++; the conversions here make a checkpoint of either optimizer
load into the other, and a resume continue bit-identically.
"""
from __future__ import annotations

import re

import torch

from elastic.errors import shorten
from megatron_rl.errors import FlexFloorError


def require_cpu_adam() -> None:
    """On the driver, for `optim.offload: cpu`, before any rank starts: DeepSpeed imports and its
    CPU Adam loads, JIT-building it if needed (once; the ranks then load the cached build). A
    failure is one line: the import's error, or the compiler's last error lines of the build."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as e:  # noqa: BLE001  (a broken install raises more than ImportError)
        raise FlexFloorError(f"optim.offload: cpu needs deepspeed (pip install deepspeed); importing it "
                             f"failed: {type(e).__name__}: {shorten(e, 300)}") from None
    try:
        CPUAdamBuilder().load(verbose=False)
    except Exception as e:  # noqa: BLE001  (torch's JIT build raises RuntimeError with ninja's output)
        raise FlexFloorError(f"optim.offload: cpu: DeepSpeed's CPU Adam did not build "
                             f"({_build_errors(e)}); a C++ compiler and ninja are needed once, or set "
                             "optim.offload: none") from None


def _build_errors(e: BaseException, keep: int = 3) -> str:
    """The last `keep` compiler error lines of a failed JIT build's output (else its first line)."""
    lines = [ln.strip() for ln in str(e).splitlines()]
    errors = [ln for ln in lines if re.search(r"\berror\b", ln)]  # gcc, clang, nvcc: "file:line: error: ..."
    shown = " | ".join(errors[-keep:]) if errors else shorten(e, 300)
    return f"{type(e).__name__}: {shown[-600:]}"


def deepspeed_cpu_adam(params, lr: float, betas, eps: float, weight_decay: float):
    """DeepSpeed's CPU AdamW (adamw_mode) over host tensors; the first use JIT-builds its C++
    extension (ninja and a C++ compiler; cached under ~/.cache/torch_extensions)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError as e:  # setup.py installs it; a bare environment gets one line
        raise RuntimeError(f"optim.offload: cpu needs deepspeed (pip install deepspeed): {e}") from None
    return DeepSpeedCPUAdam(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                            adamw_mode=True)


def saved_form(state: dict) -> dict:
    """A parameter's state with its step as a float32 tensor, as torch AdamW keeps it (DeepSpeed's
    CPU Adam keeps an int), so both optimizers' checkpoints have the same keys and types."""
    return {**state, "step": torch.as_tensor(state["step"], dtype=torch.float32)}


def adopted_form(saved: dict, inner: torch.optim.Optimizer, master: torch.Tensor) -> dict:
    """A parameter's saved state in the form `inner` keeps it (DeepSpeed's CPU Adam keys its own
    step count; torch AdamW keeps `step` as a tensor)."""
    out = {k: v.to(master.device) if k != "step" else v for k, v in saved.items()}
    if type(inner).__name__ == "DeepSpeedCPUAdam":
        out["step"] = int(out["step"])
    return out


def prime_cpu_adam(inner, step: int) -> None:
    """DeepSpeed's CPU Adam keeps beta^t in C++, per optimizer: a running one multiplies it by beta
    at each step's first parameter (the previous step's last parameter left pow(beta, t - 1)), a
    fresh one computes pow(beta, t), and the two differ in the last bit. One update of a scratch
    tensor at the loaded step leaves the C++ state where the saving optimizer had it, so a resume
    continues bit-identically."""
    g = inner.param_groups[0]
    scratch = [torch.zeros(1) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
    inner.ds_opt_adam.adam_update(inner.opt_id, step, g["lr"], g["betas"][0], g["betas"][1], g["eps"],
                                  g["weight_decay"], g["bias_correction"], *scratch)
