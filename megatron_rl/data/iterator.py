"""A deterministic, resumable prompt iterator: its whole state is (epoch, position).

Each epoch's order is a permutation seeded by (seed, epoch) alone, so a resumed run rebuilds it
from the two integers in the checkpoint instead of storing it. A batch never straddles two epochs:
the last `len(dataset) % batch_size` prompts of each epoch's order are left out of that epoch (a
different set each epoch when shuffling). That keeps "epoch" meaning one pass over the prompt set,
as the length traces the planner reads define it, with each prompt at most once per epoch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_rl.errors import FlexFloorError


@dataclass(frozen=True)
class Batch:
    epoch: int
    step_in_epoch: int
    indices: tuple[int, ...]


class PromptIterator:
    def __init__(self, num_prompts: int, batch_size: int, seed: int, shuffle: bool = True):
        if not 0 < batch_size <= num_prompts:
            raise FlexFloorError(
                f"prompts per step: expected 1 to the dataset size {num_prompts}, got {batch_size}"
            )
        self.num_prompts = num_prompts
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next batch's first prompt

    @property
    def batches_per_epoch(self) -> int:
        return self.num_prompts // self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_prompts)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def next_batch(self) -> Batch:
        if self.position + self.batch_size > self.num_prompts:
            self.epoch, self.position = self.epoch + 1, 0
        idx = self.order(self.epoch)[self.position : self.position + self.batch_size]
        batch = Batch(self.epoch, self.position // self.batch_size, tuple(int(i) for i in idx))
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict, source: str = "trainer_state.json") -> None:
        """Resume; the dataset and batching must be those the state was saved with. `source`: the
        file `state` came from, named by a missing or mistyped field's message."""
        for key, want in self.state_dict().items():
            got = state.get(key)
            if type(got) is not type(want):  # bool is no int here: a flag is not a count
                found = "nothing (the field is missing)" if key not in state else f"{got!r}"
                raise FlexFloorError(f"{source}: data position field {key!r}: expected "
                                     f"{type(want).__name__}, got {found}")
        for key in ("seed", "num_prompts", "batch_size", "shuffle"):
            mine = getattr(self, key)
            if state[key] != mine:
                raise FlexFloorError(
                    f"checkpoint data position was saved with {key}={state[key]!r}, "
                    f"this run has {key}={mine!r}: resume with the same dataset and config"
                )
        if not (0 <= state["epoch"] and 0 <= state["position"] <= self.num_prompts):
            raise FlexFloorError(f"{source}: data position: expected epoch >= 0 and position 0 to "
                                 f"{self.num_prompts}, got epoch {state['epoch']}, position {state['position']}")
        self.epoch = state["epoch"]
        self.position = state["position"]
