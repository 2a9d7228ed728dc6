import torch

from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams, choose_tokens, draws, uniform


def model(dtype=torch.float64):
    m = Qwen3MoeModel(MoEModelConfig(), dtype=dtype)
    m.init_weights(0)
    return m.eval()


def requests(n=6, new=12):
    prompts = [torch.randint(0, 256, (2 + i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(n)]
    return [Request(f"p{i}", i % 2, prompts[i], max_new_tokens=new) for i in range(n)]


def run(m, reqs, max_batch, params):
    e = RolloutEngine(m, params, max_batch, 64)
    e.add(reqs)
    steps = 0
    while e.has_work():
        e.step()
        steps += 1
    return {r.key: r.tokens for r in e.finished}, steps


def test_engine_greedy_equals_plain_forward():
    m = model()
    got, _ = run(m, requests(), 6, SamplingParams())
    for r in requests():
        ids = list(r.prompt)
        with torch.no_grad():
            for _ in range(r.max_new_tokens):
                ids.append(int(m(torch.tensor([ids]))[0, -1].argmax()))
        assert got[r.key] == ids[len(r.prompt):]


def test_tokens_do_not_depend_on_batching():
    m = model()
    for params in (SamplingParams(), SamplingParams(greedy=False, temperature=0.9, top_p=0.8, seed=3)):
        a, steps_a = run(m, requests(), 6, params)
        b, steps_b = run(m, requests(), 2, params)
        c, _ = run(m, list(reversed(requests())), 3, params)
        assert a == b == c
        assert steps_b > steps_a  # batches really differed


def test_finished_requests_leave_the_batch():
    m = model()
    e = RolloutEngine(m, SamplingParams(), 8, 64)
    e.add([Request("short", 0, [1, 2], 3, fixed_len=2), Request("long", 0, [3], 9, fixed_len=9)])
    e.step()  # prefill: first token of both
    e.step()  # decode: "short" reaches 2 tokens and leaves
    assert [r.prompt_id for r in e.live] == ["long"]
    assert [len(r.tokens) for r in e.finished] == [2]
    while e.has_work():
        e.step()
    assert sorted(len(r.tokens) for r in e.finished) == [2, 9]


def test_sampling_stream_is_keyed_by_response():
    assert uniform(0, "p", 1, 5) == uniform(0, "p", 1, 5)
    assert uniform(0, "p", 1, 5) != uniform(0, "p", 2, 5)
    logits = torch.randn(2, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(greedy=False, temperature=1.0, top_p=0.9, seed=7)
    def u(keys):
        return torch.tensor([draws(p, k, range(4, 5))[0] for k in keys], dtype=torch.float64)

    one = choose_tokens(logits, p, u([("a", 0), ("b", 0)]))
    swapped = choose_tokens(logits.flip(0), p, u([("b", 0), ("a", 0)]))
    assert one.tolist() == swapped.flip(0).tolist()


def test_top_p_keeps_draws_inside_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, -10.0, -10.0]], dtype=torch.float64)
    p = SamplingParams(greedy=False, top_p=0.5, seed=0)
    chosen = {int(choose_tokens(logits, p, torch.tensor(draws(p, ("x", s), range(1)), dtype=torch.float64))[0])
              for s in range(50)}
    assert chosen == {0}
