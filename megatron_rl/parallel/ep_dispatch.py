"""Expert-parallel token dispatch over an EP process group with `all_to_all`.

Per MoE layer and step, three collectives over the EP group, in this order on every member:
1. token counts per destination (so receivers can size their buffers),
2. the routed tokens with their expert index (dispatch),
3. the expert outputs back to their senders (combine).
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
        self.dest_E = torch.tensor([index[r] for r in owners], dtype=torch.long)

    def __call__(self, x_TD: torch.Tensor, expert_TK: torch.Tensor, bank: ExpertBank) -> torch.Tensor:
        T, K = expert_TK.shape
        D = x_TD.shape[1]
        n = len(self.members)
        flat_e = expert_TK.reshape(-1)
        if self.dest_E.device != flat_e.device:
            self.dest_E = self.dest_E.to(flat_e.device)
        dest = self.dest_E[flat_e]
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=n)
        recv = self.transport.all_to_all(send, [1] * n, [1] * n, self.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        tokens = x_TD.repeat_interleave(K, dim=0)[order]
        ids = flat_e[order].to(torch.float64)[:, None]
        # Expert ids ride along as an extra float64 column: exact for any realistic expert count.
        payload = torch.cat([tokens.to(torch.float64), ids], dim=1) if x_TD.dtype == torch.float64 \
            else None
        if payload is not None:
            got = _AllToAll.apply(payload, recv_l, send_l, self.group, self.transport)
            got_x, got_e = got[:, :D], got[:, D].long()
        else:
            got_x = _AllToAll.apply(tokens, recv_l, send_l, self.group, self.transport)
            got_e = self.transport.all_to_all(flat_e[order], recv_l, send_l, self.group)
        out = bank.compute(got_x, got_e)
        if got_x.requires_grad and not out.requires_grad:
            # No token reached this rank's experts, so `out` is a fresh empty tensor outside the
            # graph. Tie it to the input: the backward all-to-alls are collectives, and this rank
            # must join them like every other rank or the group deadlocks.
            out = out + got_x * 0
        back = _AllToAll.apply(out, send_l, recv_l, self.group, self.transport)
        result = torch.empty_like(back)
        result[order] = back
        return result.view(T, K, D)
