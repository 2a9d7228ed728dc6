"""The carried routes of a partial run's checkpoint (`partial.routes` of trainer_state.json), checked.

Each entry is [prompt_id, request sample, base64 routes] of a pending response
(`PartialRollouts.state_dict`). A resume trusts none of it unchecked: the entry names a pending
response, its routes cover exactly the positions that response's forwards read (prompt + tokens so
far - 1, as the engine records them), and they are routes (models/routes.py `decode`): every expert id
below the model's expert count, the top-k ids of each token and layer distinct. Anything else stops
the resume with one line naming the file and the field.
"""
from __future__ import annotations

import torch

from elastic.errors import shorten
from megatron_rl.errors import CheckpointError
from megatron_rl.models.routes import decode


def load_routes(entries, pool, mcfg, source) -> dict[tuple[str, int], torch.Tensor]:
    samples = {s.key: s for g in pool.pending for s in g.samples}
    out: dict[tuple[str, int], torch.Tensor] = {}
    if not isinstance(entries, list):
        raise CheckpointError(f"{source}: field partial.routes: expected a list of [prompt_id, sample, routes], "
                              f"got {type(entries).__name__}")
    for i, entry in enumerate(entries):
        where = f"{source}: field partial.routes[{i}]"
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], int) and not isinstance(entry[1], bool)):
            raise CheckpointError(f"{where}: expected [prompt_id, sample, routes], got {shorten(repr(entry), 80)}")
        key = (entry[0], entry[1])
        s = samples.get(key)
        if s is None:
            raise CheckpointError(f"{where}: response {key} is not pending in partial.pool")
        try:
            routes = decode(entry[2], mcfg.num_layers, mcfg.moe_router_topk, mcfg.num_moe_experts, where)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        want = s.prompt_len + s.n - 1 if s.n else 0
        if len(routes) != want:
            raise CheckpointError(f"{where}: expected {want} positions of routes (prompt {s.prompt_len} + "
                                  f"{s.n} tokens - 1), got {len(routes)}")
        out[key] = routes
    return out
