"""Expert-parallel token dispatch over an EP process group with `all_to_all`.

Per MoE layer and step, three collectives over the EP group, in this order on every member:
1. token counts per destination (so receivers can size their buffers),
2. the routed tokens with their expert index (dispatch: one payload of bytes in a rollout),
3. the expert outputs back to their senders (combine).
The split sizes of 2 and 3 go to NCCL as host lists: the send and receive counts are read back in
one copy, the layer's one host sync (docs/rollout.md prices it; a device-side all-to-all-v would
remove it).
A member with no tokens still makes all three calls with zero-sized splits: that is the dummy run.
The dispatcher owns the group and the expert -> owner map; `elastic/` shrinks the group by building a
new dispatcher over a smaller pre-created group and handing it to the model.

The all-to-alls go through a transport (elastic/runtime/transport.py): directly, or staged through
host memory when ranks share a GPU. Routing tables live on the tokens' device.

Gradients flow through the all-to-alls (`_AllToAll` sends them back along the reverse splits), so
the same dispatcher serves expert-parallel training: expert gradients accumulate on their owner.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from elastic.runtime.transport import DirectTransport
from megatron_rl.models.moe import ExpertBank


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, transport):
        ctx.splits, ctx.group, ctx.transport = (out_splits, in_splits), group, transport
        return transport.all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return ctx.transport.all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None, None


class AllToAllDispatcher:
    """`owners[e]` is the global rank that computes expert e; every owner must be in `group`."""

    def __init__(self, group, owners: Sequence[int], transport: DirectTransport | None = None):
        self.group, self.transport = group, transport or DirectTransport()
        self.members = dist.get_process_group_ranks(group)
        index = {r: i for i, r in enumerate(self.members)}
        missing = sorted({r for r in owners if r not in index})
        if missing:
            raise ValueError(f"expert owners {missing} are not in the EP group {self.members}")
        self.owners = list(owners)
        # The null expert (padding rows, models/moe.py) stays on this rank: it costs no bytes.
        me = index[dist.get_rank()] if dist.get_rank() in index else 0
        self.dest_E = torch.tensor([index[r] for r in owners] + [me], dtype=torch.long)

    def __call__(self, x_TD: torch.Tensor, expert_TK: torch.Tensor, bank: ExpertBank) -> torch.Tensor:
        T, K = expert_TK.shape
        n = len(self.members)
        flat_e = expert_TK.reshape(-1)
        if self.dest_E.device != flat_e.device:
            self.dest_E = self.dest_E.to(flat_e.device)
        dest = self.dest_E[flat_e]
        order = torch.argsort(dest, stable=True)
        # Rows per destination, counted on the device (bincount would read back its size on CUDA).
        send = torch.zeros(n, dtype=torch.long, device=dest.device).scatter_add_(0, dest, torch.ones_like(dest))
        recv = self.transport.all_to_all(send, [1] * n, [1] * n, self.group)
        # The layer's one host read: both split lists in one copy (NCCL takes them on the host).
        counts = torch.cat([send, recv]).tolist()
        send_l, recv_l = counts[:n], counts[n:]
        tokens = x_TD.index_select(0, order // K)  # row i of the flat (token, k) order is token i // K
        got_x, got_e = self._dispatch(tokens, flat_e[order], send_l, recv_l)
        out = bank.compute(got_x, got_e)
        if got_x.requires_grad and not out.requires_grad:
            # No token reached this rank's experts, so `out` is a fresh empty tensor outside the
            # graph. Tie it to the input: the backward all-to-alls are collectives, and this rank
            # must join them like every other rank or the group deadlocks.
            out = out + got_x * 0
        back = _AllToAll.apply(out, send_l, recv_l, self.group, self.transport)
        result = torch.empty_like(back)
        result[order] = back
        return result.view(T, K, x_TD.shape[1])

    def _dispatch(self, tokens: torch.Tensor, ids: torch.Tensor, send_l: list[int],
                  recv_l: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed rows and their expert ids to their owners, in one all-to-all where it can be."""
        D = tokens.shape[1]
        if not tokens.requires_grad:
            # Rollout: each row's bytes and its int64 expert id's 8 bytes, one uint8 payload.
            payload = torch.cat([tokens.contiguous().view(torch.uint8), ids.view(torch.uint8).view(-1, 8)], dim=1)
            got = self.transport.all_to_all(payload, recv_l, send_l, self.group)
            width = D * tokens.element_size()
            return got[:, :width].contiguous().view(tokens.dtype), got[:, width:].contiguous().view(torch.long)[:, 0]
        if tokens.dtype == torch.float64:
            # Training in float64: the ids ride along as an extra column (exact), gradients flow.
            got = _AllToAll.apply(torch.cat([tokens, ids.to(torch.float64)[:, None]], dim=1), recv_l, send_l,
                                  self.group, self.transport)
            return got[:, :D], got[:, D].long()
        got_x = _AllToAll.apply(tokens, recv_l, send_l, self.group, self.transport)
        return got_x, self.transport.all_to_all(ids, recv_l, send_l, self.group)
