"""The runtime side of online re-planning (`elastic.planning.online.rule.OnlineRule`): the status check
that feeds it, and the straggler KV migrations it asks for.

Status: one all-reduce over the current group of a vector with one entry per response of the
batch: `tokens + 1` where a rank holds the live response, `-(tokens + 1)` where it finished, 0
elsewhere. Each response is on exactly one rank, so the sum is the whole batch's state, and every
member feeds the same state to the same rule (pure numpy on the same inputs and seeds) and reaches
the same decision; before acting on one (a shrink or moves) the members check they agree with one
small all-reduce (`OnlineDriver.agree`). A rank leaves only once its responses have finished,
and those were in the last status it took part in, so the finished entries are remembered.

Migration: the decision's moves run in its order, point to point. The sender sends the request's
header, its prompt and tokens, and its KV rows (`MigratingEngine.export_request`); the receiver
adds it to its batch and sends back one confirmation; only then does the sender drop it. A failure
anywhere in between surfaces as the runtime's `ElasticFault` with the request still on its sender.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch

from elastic.planning.online.place import check_decision
from elastic.planning.online.rule import OnlineRule

TAG_MIGRATE = 1
# A migrated request's header: prompt length, tokens so far, max_new_tokens, fixed_len (-1: none),
# KV positions held, values carried with it, predicted length (-1: none) (the engine's
# `export_request` writes it in this order; the ids that follow hold the prompt, the tokens, then
# the carried values).
HEADER_SIZE = 7


class OnlineDriver:
    """One rank's view of the online rule over a rollout; `keys` in the rule's response order."""

    def __init__(self, rule: OnlineRule, keys: Sequence[tuple[str, int]], rank_of: Sequence[int], rank: int,
                 token_scale: float = 1.0):
        # `token_scale`: run tokens per rule token (a trace replayed at a length scale decodes
        # that share of each traced length; the rule reasons in trace tokens).
        self.rule, self.rank, self.scale = rule, rank, token_scale
        self.keys = list(keys)
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.rank_of = np.array(rank_of, dtype=np.int64)
        self.tokens = np.zeros(len(keys), dtype=np.int64)
        self.done = np.zeros(len(keys), dtype=bool)
        self.migrated = 0  # requests this rank received

    def status(self, engine, group) -> np.ndarray:
        """The status all-reduce; returns the live requests per rank (length: the world)."""
        vec = np.zeros(len(self.keys), dtype=np.int64)
        held = engine.progress()
        if held:
            at = [self.index[key] for key, _, _ in held]
            tokens = np.array([t for _, t, _ in held], dtype=np.int64) + 1
            vec[at] = np.where([finished for _, _, finished in held], -tokens, tokens)
        # Through the engine's transport and on its device: NCCL reduces GPU tensors only.
        v = engine.transport.all_reduce(torch.from_numpy(vec).to(engine.device), group).cpu().numpy()
        seen = v != 0
        self.tokens[seen] = np.abs(v[seen]) - 1
        self.done[seen] = v[seen] < 0
        live = ~self.done
        return np.bincount(self.rank_of[live], minlength=self.rule.plan.ranks)

    def decide(self, stage: int, tick: int):
        d = self.rule.decide(stage, round(tick / self.scale), self.rank_of,
                             np.maximum(np.rint(self.tokens / self.scale), 1), self.done)
        check_decision(self.rule.plan, stage, d, self.rank_of, self.done)
        return d

    def agree(self, engine, group, decision) -> bool:
        """Whether every member of `group` reached `decision`. The rule is replicated, so they
        should; a rank that differed (another numpy, a corrupted state) would otherwise wait in a
        shrink or a move its peers never start. One all-reduce of (1, h, h^2) for a 20-bit hash h
        of the decision: the sums are (n, n*h, n*h^2) exactly when all n hashes are equal. Taken
        only before a decision is acted on (a shrink or moves), so it costs nothing while nothing
        changes."""
        h = zlib.crc32(repr((decision.stage, decision.moves)).encode()) & 0xFFFFF
        v = engine.transport.all_reduce(torch.tensor([1, h, h * h], dtype=torch.long, device=engine.device),
                                        group).cpu().tolist()
        return v[1] == v[0] * h and v[2] == v[0] * h * h

    def migrate(self, engine, moves: Sequence[tuple[int, int]]) -> int:
        """Carry out the moves (response index, destination) in order on every rank; returns how
        many this rank sent or received. Every message goes through the engine's transport on its
        device (NCCL sends GPU tensors only)."""
        send, recv, dev = engine.transport.send, engine.transport.recv, engine.device

        def receive(n: int) -> list[int]:
            return recv(torch.zeros(n, dtype=torch.long, device=dev), src, TAG_MIGRATE).tolist()

        mine = 0
        for i, dst in moves:
            src, key = int(self.rank_of[i]), self.keys[i]
            mine += self.rank in (src, dst)
            if self.rank == src:
                header, ids, kv = engine.export_request(key)
                for t in (header, ids, kv) if kv.numel() else (header, ids):  # not yet prefilled: no KV
                    send(t.to(dev), dst, TAG_MIGRATE)
                recv(torch.zeros(1, dtype=torch.long, device=dev), dst, TAG_MIGRATE)  # the confirmation
                engine.release_request(key)  # the receiver holds it now
            elif self.rank == dst:
                header = receive(HEADER_SIZE)
                prompt_len, n_tokens, _, _, held, carried, _ = header
                ids = receive(prompt_len + n_tokens + carried)
                kv = engine.empty_kv(held)
                if held:
                    kv = recv(kv, src, TAG_MIGRATE)
                engine.import_request(key, torch.tensor(header), torch.tensor(ids), kv)
                send(torch.ones(1, dtype=torch.long, device=dev), src, TAG_MIGRATE)
                self.migrated += 1
            self.rank_of[i] = dst
        return mine

