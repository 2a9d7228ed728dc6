"""The 30B-A3B slice traced without a GPU: one decode step and one training micro-step at
Qwen3-30B-A3B's real widths (hidden 2048, 128 experts top-8, expert FFN 768, 32 query / 4 KV heads
of 128, vocab 151936) and few layers, in bf16, under torch's FakeTensorMode: shapes and dtypes are
computed, no memory is touched. The memory each step allocates is counted op by op (live bytes,
freed when the last tensor on a storage goes) and held against tools/memory_table.py's arithmetic
(megatron_rl/rollout/memory.py's budget: weights, expert copies and KV bytes; the training table,
elastic/planning/memory/train_memory.py: weights, expert copies, `activation_bytes`): within +-20%.

    python tools/gpu_slice_trace.py [--layers 2] [--batch 64] [--context 1024]
                                    [--rows 2 --seq 8192] [--no-recompute] [--chunk 1024]

Fake implementations, where the real code cannot run on fake tensors:
- the Triton decode kernels (rollout/decode_attention.py): their launches do nothing; the buffers
  `decode_attention` allocates around them (split outputs, the result) are counted as on a GPU;
- the training forward's host reads (`fake_host_reads`): the per-expert split sizes of each MoE
  layer (`ExpertBank.compute`): tokens spread evenly over the experts (the bytes a layer allocates
  depend on the tokens routed, T x top-k, not on how they split, but for experts that get none);
  and the longest position (`Qwen3MoeModel.hidden_states`, the RoPE table's length): seq - 1.

Figures (one `check` per line, `ok` when every ratio is within the tolerance), the torch backend's:
- decode: the weights, the stacked expert copies `ExpertBank.stacked` builds at the first step and
  keeps (the budget's `expert_copies`), the KV cache of `batch` sequences of `context` + the new
  token (the budget's KV bytes per token x slots x positions), the step's logits [B, V] bf16;
- training: the weights, the stacked copies, the activations at the update's peak (less the weights,
  the copies and the gradients accumulated by then) against `activation_bytes`, and the gradients
  as autograd makes them, in the model's dtype (against the weights' bytes: the table's update
  gradients are the optimizer's fp32 masters', which the trace has no optimizer to make).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.planning.memory.train_memory import OptimizerSetup, activation_bytes, training_memory  # noqa: E402
from elastic.planning.shape import MemoryBudget  # noqa: E402
from megatron_rl.backend_rules import backend_rules  # noqa: E402
from megatron_rl.models import MoEModelConfig, Qwen3MoeModel, qwen3_moe  # noqa: E402
from megatron_rl.models.moe import ExpertBank  # noqa: E402
from megatron_rl.rl.update.train_step import Packed, sequence_logprobs  # noqa: E402
from megatron_rl.rollout import decode_attention  # noqa: E402
from megatron_rl.rollout.kv.attention import Attention, KVForward  # noqa: E402
from megatron_rl.rollout.kv.cache import KVLayout  # noqa: E402
from megatron_rl.rollout.kv.slots import SlotKVCache  # noqa: E402
from megatron_rl.rollout.memory import memory_budget, weight_bytes  # noqa: E402

TOLERANCE = 0.2
SLICE = MoEModelConfig(num_layers=2, hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128,
                       num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768, vocab_size=151936)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops made and that some tensor still holds; `peak` since `reset`,
    and `peak_less`: the peak of live bytes less `excluded` (what the caller counts apart, as it
    comes: the gradients accumulated so far)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.peak_less = self.excluded = 0
        self._refs: dict[int, int] = {}  # storage -> tensors on it

    def reset(self) -> None:
        self.peak, self.peak_less = self.live, self.live - self.excluded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._hold(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._refs:
            self._refs[key] = 0
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            self.peak_less = max(self.peak_less, self.live - self.excluded)
        self._refs[key] += 1
        weakref.finalize(t, self._drop, key, storage.nbytes())

    def _drop(self, key: int, nbytes: int) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= nbytes


class NoLaunch:
    """A Triton kernel's fake: `kernel[grid](...)` does nothing (its outputs are allocated by the caller)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def fake_kernels():
    with mock.patch.object(decode_attention, "_split_kernel", NoLaunch()), \
            mock.patch.object(decode_attention, "_merge_kernel", NoLaunch()):
        yield


@contextlib.contextmanager
def fake_host_reads(longest_position: int):
    """The training forward's reads of device data, faked (the module docstring): in
    `ExpertBank.compute` each of its n held experts gets T / n of the T rows; any other `int()` of
    a tensor is the longest position."""
    compute, tolist = ExpertBank.compute, FakeTensor.tolist
    rows: list[int] = []

    def counted(bank, x_TD, expert_T):
        rows.append(x_TD.shape[0])
        try:
            return compute(bank, x_TD, expert_T)
        finally:
            rows.pop()

    def ends(t):
        if not rows or t.dtype != torch.int32 or t.dim() != 1:
            return tolist(t)
        T, n = rows[-1], t.shape[0] - 1
        return [(i + 1) * T // n for i in range(n)] + [T]  # n held experts' ends, then the null rows'

    with mock.patch.object(ExpertBank, "compute", counted), mock.patch.object(FakeTensor, "tolist", ends), \
            mock.patch.object(FakeTensor, "__int__", lambda t: longest_position, create=True):
        yield


@contextlib.contextmanager
def stacked_copies(mem: LiveBytes):
    """Counts the bytes `ExpertBank.stacked` allocates (the grouped GEMM's stacked copy of the
    bank's expert weights, built at a bank's first forward and kept: a second copy of the experts)."""
    stacked, made = ExpertBank.stacked, [0]

    def counted(bank):
        before = mem.live
        try:
            return stacked(bank)
        finally:
            made[0] += mem.live - before

    with mock.patch.object(ExpertBank, "stacked", counted):
        yield made


@contextlib.contextmanager
def faked():
    """A FakeTensorMode whose RoPE tables are its own: the model caches them (`_rope_table`), and
    a fake one must neither come from another mode nor outlive this one."""
    qwen3_moe._rope_table.cache_clear()
    try:
        with FakeTensorMode():
            yield
    finally:
        qwen3_moe._rope_table.cache_clear()


@dataclass
class Figure:
    check: str
    traced: int
    table: int | None  # memory_table's arithmetic; None: reported, not compared

    @property
    def ratio(self) -> float | None:
        if self.table is None:
            return None
        return self.traced / self.table if self.table else float("inf") if self.traced else 1.0  # 0: none expected

    @property
    def ok(self) -> bool:
        return self.ratio is None or abs(self.ratio - 1) <= TOLERANCE

    def line(self) -> str:
        vs = "" if self.table is None else f" vs table {self.table / 2**20:,.1f} MiB: {self.ratio:.3f}x"
        return f"{self.check}: traced {self.traced / 2**20:,.1f} MiB{vs}{'' if self.ok else '  OUTSIDE +-20%'}"


def slice_budget(mcfg: MoEModelConfig, dtype_bytes: int) -> MemoryBudget:
    """The rollout's budget of the slice on the torch backend (the device's size does not matter here)."""
    return memory_budget(mcfg, dtype_bytes, torch.device("cpu"), 1, device_bytes=80 * 10**9,
                         expert_copies=backend_rules("torch").expert_copies)


def decode_step(mcfg: MoEModelConfig, batch: int, context: int) -> list[Figure]:
    """Two decode steps of `batch` rows at position `context` through the Triton kernel's path: the
    first builds the stacked expert copies (kept), the second allocates what every step does."""
    dtype, max_len = torch.bfloat16, context + 1
    budget, held = slice_budget(mcfg, 2), mcfg.num_moe_experts
    with faked(), LiveBytes() as mem, fake_kernels(), stacked_copies(mem) as stacked:
        model = Qwen3MoeModel(mcfg, None, dtype).eval()
        weights = mem.live
        cache = SlotKVCache(KVLayout.of(mcfg, dtype, "cpu"), batch, max_len)
        attention = Attention(cache, decode_attention.decode_attention)  # the engine's kernel on CUDA
        kv = mem.live - weights
        with torch.inference_mode():  # as the engine steps
            pos_B = torch.full((batch,), context, dtype=torch.long)
            for _ in range(2):
                mem.reset()
                before = mem.live
                kv_step = KVForward(attention, cache.decode_batch(torch.arange(batch), pos_B, max_len, None))
                logits = model(torch.zeros(batch, 1, dtype=torch.long), pos_B[:, None], kv_step, None)
            step_peak = mem.peak - before
    assert logits.shape == (batch, 1, mcfg.vocab_size) and logits.dtype == dtype, (logits.shape, logits.dtype)
    return [Figure("decode: weights", weights, budget.dense_bytes + held * budget.expert_bytes),
            Figure("decode: stacked expert copies, built at the first step and kept", stacked[0],
                   held * budget.expert_bytes * budget.expert_copies),
            Figure(f"decode: KV cache ({batch} sequences of {max_len})", kv,
                   budget.kv_bytes_per_token * (batch + 1) * max_len),
            Figure(f"decode: a step's peak above what it keeps, batch {batch} (reported)", step_peak, None)]


def training_micro_step(mcfg: MoEModelConfig, rows: int, seq: int, recompute: bool, chunk: int,
                        dtype: torch.dtype = torch.bfloat16) -> list[Figure]:
    """Forward and backward of a policy-gradient loss over `rows` sequences of `seq` tokens (one
    micro-batch) in `dtype`, with the trainer's `recompute_activations` and `logprob_chunk_tokens`,
    the log-probs and entropy computed as the update asks. The activations are the update's peak of
    live bytes less the weights, the stacked copies and the gradients accumulated by then, against
    the table's `activation_bytes`."""
    tokens, b = rows * seq, dtype.itemsize
    with faked(), LiveBytes() as mem, fake_host_reads(seq - 1), stacked_copies(mem) as stacked:
        model = Qwen3MoeModel(mcfg, None, dtype).train()
        model.recompute_activations = recompute
        weights = mem.live
        for p in model.parameters():  # the gradients are counted apart, as each is accumulated
            p.register_post_accumulate_grad_hook(lambda p: setattr(mem, "excluded", mem.excluded + p.grad.nbytes))
        ids = torch.zeros(rows, seq + 1, dtype=torch.long)
        packed = Packed(ids[:, :-1], ids[:, 1:], torch.ones(rows, seq), torch.ones(rows, seq, dtype=torch.bool))
        logp, _entropy = sequence_logprobs(model, packed, chunk_tokens=chunk, entropy=True)  # as the update asks
        # A policy-gradient surrogate over the response tokens: the GRPO loss's [B, S] terms add
        # kilobytes here, against the gigabytes of the model's activations.
        loss = -(logp * packed.loss_mask).sum() / tokens
        loss.backward()
        kept = mem.peak_less - weights - stacked[0]
        grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    assert logp.shape == (rows, seq) and all(p.grad is None or p.grad.dtype == dtype for p in model.parameters())
    budget = slice_budget(mcfg, b)
    dense_params, expert_params = weight_bytes(mcfg, 1)  # one byte per parameter: the parameter counts
    table = training_memory(dense_params=dense_params, expert_params_per_expert=expert_params,
                            experts_held=mcfg.num_moe_experts, world=1,
                            setup=OptimizerSetup("torch", "replicated", b < 4, b),
                            activations=activation_bytes(mcfg.shape(b, budget, ranks_per_node=1), tokens, recompute,
                                                         chunk),
                            expert_copies=budget.expert_copies)
    how = f"{rows} x {seq} tokens, recompute {recompute}, log-prob chunk {chunk or 'none'}"
    return [Figure("training: weights", weights, table.weights),
            Figure("training: stacked expert copies, built at the forward and kept", stacked[0], table.expert_copies),
            Figure(f"training: activations at the update's peak ({how})", kept, table.activations),
            Figure("training: gradients, in the model's dtype (vs the weights)", grads, table.weights)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=SLICE.num_layers)
    p.add_argument("--batch", type=int, default=64, help="decode rows")
    p.add_argument("--context", type=int, default=1024, help="positions each decode row already holds")
    p.add_argument("--rows", type=int, default=2, help="training micro-batch sequences (the 30B example's)")
    p.add_argument("--seq", type=int, default=8192, help="training sequence length (the 30B example's)")
    p.add_argument("--no-recompute", dest="recompute", action="store_false",
                   help="keep every layer's activations (the 30B example recomputes them)")
    p.add_argument("--chunk", type=int, default=1024, help="log-prob chunk tokens (the 30B example's; 0: none)")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args(argv)
    mcfg = replace(SLICE, num_layers=a.layers)
    figures = decode_step(mcfg, a.batch, a.context) + training_micro_step(mcfg, a.rows, a.seq, a.recompute, a.chunk)
    print(f"30B-A3B slice, {a.layers} layers, bf16, traced under FakeTensorMode (no memory touched):")
    for f in figures:
        print("  " + f.line())
    ok = all(f.ok for f in figures)
    if a.json:
        Path(a.json).write_text(json.dumps([{"check": f.check, "traced": f.traced, "table": f.table,
                                             "ok": f.ok} for f in figures], indent=1))
    print("gpu_slice_trace: " + ("every figure within +-20% of the table" if ok else "a figure is OUTSIDE +-20%"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
