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
        require(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")


def uniform(seed: int, prompt_id: str, sample: int, step: int) -> float:
    """A uniform draw in [0, 1) fixed by the response's identity and the step."""
    h = hashlib.blake2b(f"{seed}\x00{prompt_id}\x00{sample}\x00{step}".encode(), digest_size=8)
    return (struct.unpack("<Q", h.digest())[0] >> 11) * (1.0 / (1 << 53))


def choose_tokens(logits_BV: torch.Tensor, params: SamplingParams,
                  keys: list[tuple[str, int]], steps: list[int]) -> torch.Tensor:
    """Next token for each row; `keys[b]` = (prompt_id, sample), `steps[b]` = tokens generated so far."""
    if params.greedy:
        return logits_BV.argmax(dim=-1)
    probs_BV = torch.softmax(logits_BV.double() / params.temperature, dim=-1)
    # Stable sort by -p then id: ties resolve by token id, independent of anything else in the batch.
    order_BV = torch.sort(-probs_BV, dim=-1, stable=True).indices
    sorted_BV = torch.gather(probs_BV, 1, order_BV)
    cum_BV = sorted_BV.cumsum(dim=-1)
    out = torch.empty(len(keys), dtype=torch.long)
    for b, ((pid, s), t) in enumerate(zip(keys, steps)):
        # Nucleus: the smallest prefix whose mass reaches top_p (at least one token).
        n = int(torch.searchsorted(cum_BV[b], torch.tensor(params.top_p, dtype=cum_BV.dtype)).item()) + 1
        n = min(n, cum_BV.shape[1])
        u = uniform(params.seed, pid, s, t) * cum_BV[b, n - 1].item()
        j = int(torch.searchsorted(cum_BV[b, :n], torch.tensor(u, dtype=cum_BV.dtype), right=True).item())
        out[b] = order_BV[b, min(j, n - 1)]
    return out
