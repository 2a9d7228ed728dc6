"""The expert-parallel engine over gloo equals the single-process model, on any number of ranks."""
import pytest
import torch

from megatron_rl.config import load_dataclass
from megatron_rl.models import Qwen3MoeModel
from megatron_rl.rollout.batch import load_trace, make_requests, select_epoch
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout_runner import run_rollout

pytestmark = pytest.mark.timeout(240)


def config(trace, ranks, greedy=True, **extra):
    o = {"batch.trace": str(trace), "batch.length_scale": 0.004, "ranks": ranks,
         "sampling.greedy": greedy, "sampling.temperature": 0.8, "sampling.top_p": 0.9,
         "timeout_s": 120.0}
    o.update(extra)
    return load_dataclass(RolloutConfig, None, o)


@pytest.fixture(scope="module")
def reference(tailed_trace):
    return single_process_greedy(config(tailed_trace, 1))


def by_key(responses):
    return {(r["prompt_id"], r["sample"]): r["tokens"] for r in responses}


def single_process_greedy(cfg):
    """Greedy tokens of the plain single-process model (no engine, no cache, no EP)."""
    trace = load_trace(cfg.batch, cfg.seed)
    batch, _ = select_epoch(trace, None)
    model = Qwen3MoeModel(cfg.model, dtype=torch.float64)
    model.init_weights(cfg.seed)
    out = {}
    with torch.no_grad():
        for r in make_requests(batch, cfg.batch, cfg.seed, cfg.model.vocab_size):
            ids = list(r.prompt)
            for _ in range(r.fixed_len):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            out[r.key] = ids[len(r.prompt):]
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_ep_greedy_equals_single_process_model(tailed_trace, reference, ranks):
    run = run_rollout(config(tailed_trace, ranks), quiet=True)
    report, responses = run.report, run.responses
    assert report["ranks"] == ranks and report["responses"] == 32
    assert by_key(responses) == reference
    assert report["rank_steps"]["dummy"] > 0  # a length-tailed batch leaves ranks stepping empty


def test_seeded_sampling_same_sha_on_1_2_4_ranks(tailed_trace):
    shas = {w: run_rollout(config(tailed_trace, w, greedy=False), quiet=True).report["responses_sha256"]
            for w in (1, 2, 4)}
    assert len(set(shas.values())) == 1, shas
    greedy = run_rollout(config(tailed_trace, 2), quiet=True).report["responses_sha256"]
    assert greedy != shas[1]  # sampling really sampled
