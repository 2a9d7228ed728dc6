"""bf16 that learns: fp32 master weights, fp32 gradient accumulation, exact checkpoint resume; and
the two training-memory switches (activation recomputation, chunked log-probs) change no number."""
import pytest
import torch

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.moe import LocalDispatcher
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.rl.optim.mixed_precision import MixedPrecisionOptimizer, grad_params
from megatron_rl.rl.update.train_step import (
    allreduce_dense_grads,
    clip_global_grad_norm,
    make_optimizer,
    pack,
    sequence_logprobs,
)

CFG = MoEModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                     kv_channels=8, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                     vocab_size=40)


def _model(dtype):
    model = Qwen3MoeModel(CFG, None, dtype)
    model.init_weights(0)
    model.set_dispatcher(LocalDispatcher())
    return model


def _packed(seed=0, rows=3):
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(rows):
        n_p, n_r = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(3, 9, (1,), generator=g))
        data.append((torch.randint(3, 40, (n_p,), generator=g).tolist(),
                     torch.randint(3, 40, (n_r,), generator=g).tolist()))
    return pack(data, 0)


def _train(model, optimizer, steps, packed):
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = -(sequence_logprobs(model, packed) * packed.loss_mask).sum() / packed.tokens
        loss.backward()
        named = grad_params(model, optimizer)
        allreduce_dense_grads(named, 1)
        clip_global_grad_norm(named, 1.0, 1)
        optimizer.step()


def _changed_share(model, before) -> float:
    changed = total = 0
    for n, p in model.named_parameters():
        changed += int((p != before[n]).sum())
        total += p.numel()
    return changed / total


def test_bf16_masters_learn_at_small_lr_where_direct_bf16_adamw_does_not():
    packed, steps = _packed(), 100
    direct = _model(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in direct.named_parameters()}
    _train(direct, torch.optim.AdamW(direct.parameters(), lr=1e-6), steps, packed)
    direct_share = _changed_share(direct, before)

    mixed = _model(torch.bfloat16)
    opt = make_optimizer(mixed, 1e-6)
    assert isinstance(opt, MixedPrecisionOptimizer)
    _train(mixed, opt, steps, packed)
    mixed_share = _changed_share(mixed, before)
    # Direct bf16 AdamW rounds each ~1e-6 step away except on the tiniest weights; the fp32
    # masters accumulate 100 steps (~1e-4), enough to move most bf16 weights.
    assert direct_share < 0.05, direct_share
    assert mixed_share > 0.5, mixed_share
    for name, master in opt.named_grad_params():
        assert master.dtype == torch.float32
        assert all(v.dtype == torch.float32 for v in opt.inner.state[master].values() if v.ndim)
        assert torch.equal(dict(mixed.named_parameters())[name], master.to(torch.bfloat16))


def test_fp32_and_fp64_models_keep_plain_adamw():
    for dtype in (torch.float32, torch.float64):
        assert type(make_optimizer(_model(dtype), 1e-3)) is torch.optim.AdamW


def test_gradients_accumulate_in_fp32_on_the_masters():
    model = _model(torch.bfloat16)
    opt = make_optimizer(model, 1e-3)
    opt.zero_grad()
    expected = {}
    for seed in (1, 2):
        probe = _model(torch.bfloat16)  # same weights, its own bf16 gradient of this micro-batch
        packed = _packed(seed)
        for m in (model, probe):
            (-(sequence_logprobs(m, packed) * packed.loss_mask).sum()).backward()
        for n, p in probe.named_parameters():
            g = p.grad.float()
            expected[n] = g if n not in expected else expected[n] + g
    for n, master in opt.named_grad_params():
        assert torch.equal(master.grad, expected[n]), n
    assert all(p.grad is None for p in model.parameters())  # bf16 grads freed once moved


def test_closed_optimizer_leaves_the_model_its_own_gradients():
    model = _model(torch.bfloat16)
    opt = make_optimizer(model, 1e-3)
    opt.close()
    packed = _packed()
    (-(sequence_logprobs(model, packed) * packed.loss_mask).sum()).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_checkpoint_resume_is_bit_identical(tmp_path, one_rank_group):
    from elastic.trace import Trace
    from megatron_rl.rl.checkpoint.dcp import load_checkpoint, save_checkpoint

    packed = _packed()
    model = _model(torch.bfloat16)
    opt = make_optimizer(model, 1e-4, weight_decay=0.01)
    _train(model, opt, 3, packed)
    path = save_checkpoint(tmp_path, 3, model, opt, None, {}, Trace([], "h"), 0)
    _train(model, opt, 2, packed)

    resumed = _model(torch.bfloat16)
    ropt = make_optimizer(resumed, 1e-4, weight_decay=0.01)
    load_checkpoint(path, resumed, ropt, None)
    _train(resumed, ropt, 2, packed)
    for (n, a), (_, b) in zip(model.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), n
    masters = dict(opt.named_grad_params())
    for n, b in ropt.named_grad_params():
        assert torch.equal(masters[n], b), n
        for k, v in opt.inner.state[masters[n]].items():
            assert torch.equal(v, ropt.inner.state[b][k]), (n, k)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_logprobs_equal_unchunked_values_and_grads(chunk, monkeypatch):
    import megatron_rl.rl.update.train_step as ts

    packed = _packed(rows=4)
    B, S = packed.input_ids.shape
    seen = []  # the logits' leading sizes, forward and (recomputed) backward
    real = ts.token_logprobs
    monkeypatch.setattr(ts, "token_logprobs", lambda logits, t: seen.append(logits.shape[:-1]) or real(logits, t))
    out = {}
    for c in (0, chunk):
        seen.clear()
        model = _model(torch.float64)
        logp = sequence_logprobs(model, packed, temperature=0.7, chunk_tokens=c)
        (logp * packed.loss_mask).sum().backward()
        out[c] = logp.detach(), {n: p.grad for n, p in model.named_parameters()}
        if c:
            assert max(s.numel() for s in seen) == min(c, B * S)
            assert len(seen) == 2 * -(-B * S // c)  # every chunk once forward, once in backward
    torch.testing.assert_close(out[chunk][0], out[0][0], rtol=0, atol=1e-13)
    for n, g in out[0][1].items():
        torch.testing.assert_close(out[chunk][1][n], g, rtol=0, atol=1e-13, msg=n)


def test_activation_recomputation_gives_the_same_gradients(monkeypatch):
    from megatron_rl.models.qwen3_moe import DecoderLayer

    packed = _packed(rows=4)
    grads, calls = {}, {}
    real = DecoderLayer.forward
    for recompute in (False, True):
        model = _model(torch.float64)
        model.recompute_activations = recompute
        calls[recompute] = log = []
        # Counted on `forward` itself: checkpoint's rerun in backward skips module hooks.
        monkeypatch.setattr(DecoderLayer, "forward", lambda *a, log=log, **k: log.append(1) or real(*a, **k))
        logp = sequence_logprobs(model, packed, chunk_tokens=5)
        (logp * packed.loss_mask).sum().backward()
        grads[recompute] = {n: p.grad for n, p in model.named_parameters()}
    # Recomputation reruns every decoder layer's forward once in backward.
    assert (len(calls[False]), len(calls[True])) == (CFG.num_layers, 2 * CFG.num_layers)
    for n, g in grads[False].items():
        assert torch.equal(grads[True][n], g), n
