"""The bodies of the decode engine's GPU checks (tests/gpu/test_decode_engine_gpu.py runs
them on CUDA), written for any device so that tests/unit/tools/test_gpu_decode_checks.py runs them small
on CPU, where there are no graphs and no sync debug mode but the same engine path.

`sync_free_steps`: decode steps under `torch.cuda.set_sync_debug_mode("error")` (a blocking host
sync raises), eager and replayed; on CUDA the graphed engine must have captured its graphs and
replayed one per decode step (`counted_replays`), so a silent fallback to eager fails.
`replay_matches_eager`: a graphed engine's responses equal an
eager one's on the same weights (bf16 on the GPU), before and after the KV cache was released and
reclaimed and an expert moved out and back, which must re-capture the graphs. The eager reference is
padded to the same buckets (cuBLAS picks kernels by M, so an unpadded 13-row batch rounds bf16
differently from the 16-row bucket), and a response may part from it only at a near tie of the
reference's logits (margin-aware: a last-bit difference then flips the greedy choice). `capture_safe`: every
bucket's graphed region traced op by op (tools/capture_safety.py): no host read, data-dependent
shape, RNG op or host-to-device copy, and the same trace for different inputs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import torch

from tests.gpu.checks.gpu_checks import SMALL_QWEN3_MOE, _model


def _requests(n: int, vocab: int, new: int = 24):
    from megatron_rl.rollout.engine import Request

    g = torch.Generator().manual_seed(1)
    return [Request(f"p{i}", 0, torch.randint(0, vocab, (8 + i,), generator=g).tolist(), new, fixed_len=new)
            for i in range(n)]


def _engine(model, graphs: bool, batch: int, max_len: int = 64, pad: bool | None = None):
    from megatron_rl.rollout.decode_step import DecodeOptions
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    return RolloutEngine(model, SamplingParams(greedy=True), batch, max_len,
                         decode=DecodeOptions(graphs=graphs, pad=graphs if pad is None else pad))


NEAR_TIE = 0.05  # logit standard deviations: bf16 rounds a logit by about 1% of its spread


def _near_tie(model, prompt: list[int], want: list[int], got: list[int]) -> bool:
    """Whether `got` parts from `want` where the model's two choices are within NEAR_TIE."""
    i = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    ids = torch.tensor([prompt + want[:i]], device=model.device)
    with torch.no_grad():
        logits = model(ids)[0, -1].float()
    return bool((logits[want[i]] - logits[got[i]]).abs() <= NEAR_TIE * logits.std())


@dataclass
class Count:
    n: int = 0


@contextlib.contextmanager
def counted_replays():
    """Counts CUDA graph replays while inside: a graph's kernels run without Python, so its
    replay is the evidence that the graphed path ran (and not an eager fallback)."""
    count, replay = Count(), torch.cuda.CUDAGraph.replay

    def counting(graph):
        count.n += 1
        return replay(graph)

    with mock.patch.object(torch.cuda.CUDAGraph, "replay", counting):
        yield count


def _run(eng) -> dict:
    while eng.has_work():
        eng.step()
    out = {r.key: r.tokens for r in eng.finished}
    eng.finished = []
    return out


def capture_safe(mcfg=SMALL_QWEN3_MOE, *, device: str = "cuda", dtype=torch.bfloat16, batch: int = 64) -> dict:
    """tools/capture_safety.py over every bucket up to `batch`, on `device` (eagerly: the region a
    graph would capture, traced by a dispatch mode)."""
    from tools import capture_safety

    eng = _engine(_model(mcfg, 0, dtype, device), False, batch)
    eng.runner.pad = True
    out = capture_safety.check(eng)
    return {**out, "evidence": {"buckets traced": len(out["buckets"])}}


def sync_free_steps(mcfg=SMALL_QWEN3_MOE, *, device: str = "cuda", dtype=torch.bfloat16, batch: int = 16,
                    steps: int = 4, graphs: bool | None = None) -> dict:
    """`steps` decode steps of a padded batch (batch - 3 rows) per mode, under sync debug mode "error"
    on CUDA: any blocking sync raises, and the check fails with it. `graphs` (default: on CUDA): the
    graphed engine must have captured its graphs and replayed one per decode step; an eager
    fallback fails (on CPU there are no graphs: `graphs=True` there is the negative control)."""
    model = _model(mcfg, 0, dtype, device)
    cuda = torch.device(device).type == "cuda"
    expect = cuda if graphs is None else graphs
    with counted_replays() as replays:
        for graphed in (False, True):
            eng = _engine(model, graphed, batch)
            eng.capture_graphs()
            eng.add(_requests(batch - 3, mcfg.vocab_size))
            eng.step()  # prefill (it may sync: the prompts are staged through pinned memory)
            eng.step()  # the first decode step builds what is built once
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            before = replays.n
            try:
                for _ in range(steps):
                    eng.step()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        captures, replayed = eng.runner.captures, replays.n - before
    evidence = {"decode steps": 2 * steps}
    if expect:
        evidence.update({"graph captures": captures, "graph replays": replayed})
    ok = not expect or (captures >= 1 and replayed == steps)
    return {"ok": ok, "evidence": evidence,
            "summary": f"{steps} decode steps eager and {steps} graphed raised nothing; graphs captured {captures} "
                       f"time(s), {replayed} of the {steps} graphed steps replayed"
                       + ("" if ok else " (an EAGER FALLBACK: the graphs were not replayed)")
                       + ("" if cuda else " (CPU: no graphs)")}


def replay_matches_eager(mcfg=SMALL_QWEN3_MOE, *, device: str = "cuda", dtype=torch.bfloat16,
                         batch: int = 16) -> dict:
    from megatron_rl.rollout.elastic_engines.torch_engine import ElasticRolloutEngine

    model = _model(mcfg, 0, dtype, device)
    reqs = _requests(batch - 3, mcfg.vocab_size)  # 13 rows: the 16 bucket, with padding
    prompts = {r.key: r.prompt for r in reqs}
    eager_eng = _engine(model, False, batch, pad=True)  # the graphs' row count, eagerly
    eager_eng.add(reqs)
    eager = _run(eager_eng)
    eng = _engine(model, True, batch)
    eng.add(_requests(batch - 3, mcfg.vocab_size))
    with counted_replays() as replays:
        graphed = _run(eng)
    same = sum(eager[k] == graphed[k] for k in eager)
    ties = sum(_near_tie(model, prompts[k], eager[k], graphed[k]) for k in eager if eager[k] != graphed[k])
    captures = eng.runner.captures
    # A lease's KV release and reclaim, then an expert moved out and back: both need new graphs.
    el = ElasticRolloutEngine(eng, world=1)
    el.release_memory()
    el.reclaim_memory()
    flat = el.export_expert(5).clone()
    el.drop_expert(5)
    el.import_expert(5, flat)
    eng.add(_requests(batch - 3, mcfg.vocab_size))
    with counted_replays() as replays_after:
        after = _run(eng)
    recaptured = eng.runner.captures - captures
    cuda = torch.device(device).type == "cuda"
    evidence = {"responses compared": len(eager) + len(after)}
    if cuda:
        evidence.update({"graph replays before the changes": replays.n, "after": replays_after.n})
    ok = same + ties == len(eager) and after == graphed and (recaptured >= 1 or not cuda)
    return {"ok": ok, "same": same, "near_ties": ties, "responses": len(eager), "recaptured": recaptured,
            "evidence": evidence,
            "summary": f"{same}/{len(eager)} responses identical to padded eager ({ties} more part at a near tie); "
                       f"after KV release/reclaim and an expert move {'identical' if after == graphed else 'DIFFERENT'}"
                       f", {recaptured} re-capture(s)"}


def _even_share(tokens: list[int]) -> float:
    """A reward of the responses themselves (gpu_checks' shaped reward): the share of even token ids."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


POLICIES = (("vanilla", None), ("natural", 1), ("planned", 1), ("lengthsort", None), ("adaptive", 1))


def bf16_policies(*, device: str = "cuda", dtype: str = "bfloat16", prompts: int = 8, samples: int = 4,
                  length_scale: float = 0.01, policies=POLICIES) -> dict:
    """Check (b) in bf16: every policy on 2 ranks sharing `device` (host-staged transport), greedy,
    against vanilla: the share of responses identical to vanilla's and the mean reward difference.
    Natural floor 1 keeps each rank's batches and each expert's row order, so it must equal vanilla
    (docs/rollout.md, "bf16 on GPUs"); the others are measured, not judged."""
    from megatron_rl.config import load_dataclass
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout_runner import run_rollouts

    base = {"ranks": 2, "device": device, "transport": "host", "dtype": dtype, "batch.prompts": prompts,
            "batch.samples": samples, "batch.length_scale": length_scale, "timeout_s": 120.0}
    cfgs = [load_dataclass(RolloutConfig, None, {**base, "policy": p, **({"floor": f} if f else {})})
            for p, f in policies]
    results = run_rollouts(cfgs, quiet=True)
    by_key = [{(r["prompt_id"], r["sample"]): r["tokens"] for r in run.responses} for run in results]
    vanilla = by_key[0]
    reward_v = sum(_even_share(t) for t in vanilla.values()) / len(vanilla)
    rows = {}
    for (policy, floor), got in zip(policies[1:], by_key[1:]):
        same = sum(got.get(k) == t for k, t in vanilla.items()) / len(vanilla)
        reward = sum(_even_share(t) for t in got.values()) / max(len(got), 1)
        rows[f"{policy}" + (f" floor {floor}" if floor else "")] = {"identical": same, "reward_diff": reward - reward_v}
    ok = rows["natural floor 1"]["identical"] == 1.0
    evidence = {"policies compared with vanilla": len(rows), "responses each": len(vanilla)}
    summary = f"{dtype}, identical to vanilla / reward difference: " + "; ".join(
        f"{name} {r['identical']:.0%} / {r['reward_diff']:+.3f}" for name, r in rows.items())
    return {"ok": ok, "rows": rows, "evidence": evidence, "summary": summary}
