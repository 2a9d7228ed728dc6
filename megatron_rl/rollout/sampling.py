"""Token choice that depends on nothing but the response itself.

Each response draws its random numbers from a counter-based stream keyed by
`(seed, prompt_id, sample, step)`: a BLAKE2b hash, not a stateful generator, so the draw for step t
of a response is the same whichever rank, batch or position in the batch produced it. Sampling is
inverse-CDF over the top-p nucleus sorted by (probability desc, token id asc), a fixed order.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

from megatron_rl.config import require


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = True
    seed: int = 0

    def __post_init__(self):
        require(self.temperature > 0, f"temperature: expected > 0, got {self.temperature}")
        require(0 < self.top_p <= 1, f"top_p: expected in (0, 1], got {self.top_p}")


def uniform(seed: int, prompt_id: str, sample: int, step: int) -> float:
    """A uniform draw in [0, 1) fixed by the response's identity and the step."""
    h = hashlib.blake2b(f"{seed}\x00{prompt_id}\x00{sample}\x00{step}".encode(), digest_size=8)
    return (struct.unpack("<Q", h.digest())[0] >> 11) * (1.0 / (1 << 53))


def draws(params: SamplingParams, key: tuple[str, int], steps: range) -> list[float]:
    """The response `key`'s uniform draws for `steps` (the engine makes them at admission)."""
    return [uniform(params.seed, key[0], key[1], t) for t in steps]


def choose_tokens(logits_BV: torch.Tensor, params: SamplingParams, u_B: torch.Tensor | None) -> torch.Tensor:
    """Next token for each row; `u_B` holds row b's uniform draw for this step (`draws`), on the
    logits' device: sampling reads nothing back (None when greedy)."""
    if params.greedy:
        return logits_BV.argmax(dim=-1)
    probs_BV = torch.softmax(logits_BV.double() / params.temperature, dim=-1)
    # Stable sort by -p then id: ties resolve by token id, independent of anything else in the batch.
    order_BV = torch.sort(-probs_BV, dim=-1, stable=True).indices
    cum_BV = torch.gather(probs_BV, 1, order_BV).cumsum(dim=-1)
    # Nucleus: the smallest prefix whose mass reaches top_p (at least one token), n_B tokens long.
    top_p = torch.full((logits_BV.shape[0], 1), params.top_p, dtype=cum_BV.dtype, device=cum_BV.device)
    n_B1 = (torch.searchsorted(cum_BV, top_p) + 1).clamp(max=cum_BV.shape[1])
    u_B1 = u_B.to(cum_BV.dtype)[:, None] * cum_BV.gather(1, n_B1 - 1)
    # u < the nucleus mass, so searching the whole row finds the same index as searching the nucleus;
    # the clamp keeps a draw that rounds up to the mass inside it. One batched op: no per-row syncs.
    j_B1 = torch.minimum(torch.searchsorted(cum_BV, u_B1, right=True), n_B1 - 1)
    return order_BV.gather(1, j_B1)[:, 0]
