"""The one interface between `elastic/` and an engine: an engine whose EP group can shrink.

The real engine (`megatron_rl.rollout.elastic_engines.torch_engine.ElasticRolloutEngine`) implements it over
torch, and its `MigratingRolloutEngine` the `MigratingEngine` below; the simulator needs none of
it. Expert weights cross this boundary as one flat tensor per expert (every layer's weights of that
expert, concatenated in a fixed order), so moving an expert is one message. Buffers the runtime
makes (status counts, receive buffers) are on the engine's `device`, and every tensor it exchanges
goes through the engine's `transport` (elastic/runtime/transport.py).
"""
from __future__ import annotations

from typing import Any, Protocol


class ElasticEngine(Protocol):
    device: Any  # a torch.device
    transport: Any  # a DirectTransport or HostStagedTransport

    def load(self) -> int:
        """Local requests not yet finished; 0 means this rank has drained."""

    def step(self) -> int:
        """One synchronous EP step over the current group; returns tokens generated locally."""

    def dummy_step(self) -> None:
        """Join the step's collectives with no local tokens."""

    def held_experts(self) -> list[int]:
        """Global indices of the experts this rank holds now."""

    def export_expert(self, expert: int) -> Any:
        """The expert's weights as one flat tensor."""

    def empty_expert(self) -> Any:
        """A receive buffer for one expert."""

    def import_expert(self, expert: int, flat: Any) -> None:
        """Hold `expert` with these weights from now on."""

    def drop_expert(self, expert: int) -> None:
        """Stop holding `expert` (frees its memory)."""

    def use_group(self, group: Any, owners: dict[int, int]) -> None:
        """From the next step, route through `group`, with expert e computed on rank owners[e]."""

    def expert_bytes(self) -> int:
        """Memory of the experts held now."""

    def release_memory(self) -> int:
        """Detached, with no live request: free the KV cache for a lease; returns the bytes freed."""

    def reclaim_memory(self) -> None:
        """Re-allocate what `release_memory` freed (before the restore)."""

    def checksums(self) -> dict[str, float]:
        """Checksums of the weights this rank holds, by name (experts as `expert.<e>`)."""


class MigratingEngine(ElasticEngine, Protocol):
    """An engine whose live requests can move between ranks (`elastic.runtime.online`)."""

    def progress(self) -> list[tuple[tuple[str, int], int, bool]]:
        """(key, tokens generated, finished) of every request this rank holds or has finished."""

    def export_request(self, key: tuple[str, int]) -> tuple[Any, Any, Any]:
        """Header (`online.HEADER_SIZE` ints), prompt + tokens (+ carried values), and KV rows of a live request."""

    def empty_kv(self, held: int) -> Any:
        """A receive buffer for the KV rows of a request holding `held` positions."""

    def import_request(self, key: tuple[str, int], header: Any, ids: Any, kv: Any) -> None:
        """Continue the request from exactly where its sender left it."""

    def release_request(self, key: tuple[str, int]) -> None:
        """Drop a request that another rank has confirmed it holds."""
