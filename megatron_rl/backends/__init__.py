"""The MoE backend of a run as an object that builds: its training model and optimizer, its elastic
engine, and how the trainer keeps its expert modules across a rollout.

The config names the backend (`backend_rules.BACKENDS`) and checks what it can (`backend_rules`:
dtypes, training refusals, the preflight); `backend(name)` gives the object, which the command or
its rank entry builds once and hands down (as megatron-core picks its dispatcher class once, and
vLLM its executor): code below asks it instead of comparing the name. It stands above rollout/ and
rl/, whose engines and optimizers it builds; nothing there imports it. A `Backend` (`base.py`) holds
what differs between the plain-PyTorch MoE (`torch.py`) and megatron-core's (`megatron.py`).
"""
from __future__ import annotations

import functools

from megatron_rl.backend_rules import backend_rules
from megatron_rl.backends.base import Backend
from megatron_rl.backends.megatron import MegatronBackend
from megatron_rl.backends.torch import TorchBackend

__all__ = ["Backend", "backend"]


@functools.cache
def backend(name: str) -> Backend:
    """The backend called `name` (one of `backend_rules.BACKENDS`), built once per process."""
    backend_rules(name)  # an unknown name is the config's error
    return next(kind() for kind in (TorchBackend, MegatronBackend) if kind.name == name)
