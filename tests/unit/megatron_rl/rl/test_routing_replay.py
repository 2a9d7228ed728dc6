"""Rollout routing replay (R3, models/routes.py): routes recorded by the engine, moved with a
migrated request, kept in a partial run's checkpoint, replayed in training; their memory; masked
importance sampling."""
import pytest
import torch

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.models.routes import RouteReplay, encode, replaying, route_bytes_per_token, route_dtype
from megatron_rl.rl.rollout_phase.recording_engine import RecordingEngine
from megatron_rl.rollout.engine import Request
from megatron_rl.rollout.kv.kind import PagedKV
from megatron_rl.rollout.route_record import CarriedValues
from megatron_rl.rollout.sampling import SamplingParams

TINY = MoEModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                      num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16, vocab_size=20)
# More experts than TINY, so that bf16 near-ties exist among few tokens.
WIDE = MoEModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                      num_moe_experts=32, moe_router_topk=4, moe_ffn_hidden_size=32, vocab_size=64,
                      init_method_std=0.05)


def _model(cfg, dtype, seed=0):
    model = Qwen3MoeModel(cfg, None, dtype)
    model.init_weights(seed)
    return model.eval()


def _requests(n=4, new=12):
    return [Request(f"p{i}", i, [1 + (3 * i + j) % 17 for j in range(3 + i)], new, fixed_len=new) for i in range(n)]


def _generate(model, greedy=True, engine_wrap=None, requests=None, **engine_kw):
    e = RecordingEngine(model, SamplingParams(greedy=greedy, seed=1), 3, 40, temperature=1.0, **engine_kw)
    e.add(requests or _requests())
    e.recorder.start({})
    while e.has_work():
        e.step()
    return e, e.recorder.routes([])


def _training_forward(model, engine, routes, replay: bool):
    """Log-probs of every finished response under the training forward, and its RouteReplay."""
    from megatron_rl.rl.rollout_phase.phase import Response
    from megatron_rl.rl.update.policy_update import routes_of
    from megatron_rl.rl.update.train_step import pack, sequence_logprobs

    rs = [Response(i, r.prompt_id, r.sample, r.prompt, r.tokens, engine.logprobs[r.key], False, routes[r.key])
          for i, r in enumerate(sorted(engine.finished, key=lambda r: r.key))]
    packed = pack([(r.prompt, r.tokens) for r in rs], 0)
    routes_TLK, has_T, _ = routes_of(rs, list(range(len(rs))), packed.input_ids.shape[1], model.config)
    mask_T = packed.token_mask.reshape(-1)
    with torch.no_grad(), replaying(model, RouteReplay(routes_TLK, has_T & mask_T, mask_T, replay, True)) as rep:
        logp = sequence_logprobs(model, packed, 1.0, 0)
    rollout = torch.zeros_like(logp, dtype=torch.float64)
    rollout[packed.loss_mask.bool()] = torch.tensor([lp for r in rs for lp in r.logprobs], dtype=torch.float64)
    gap = ((logp.double() - rollout).abs() * packed.loss_mask).sum() / packed.loss_mask.sum()
    return logp, rep, float(gap)


def test_route_bytes_and_the_planners_budget():
    from megatron_rl.rollout.memory import kv_bytes_per_token, memory_budget

    assert route_dtype(128) == torch.uint8 and route_dtype(257) == torch.int16 and route_dtype(1 << 16) == torch.int32
    qwen = MoEModelConfig(num_layers=48, num_moe_experts=128, moe_router_topk=8)
    assert route_bytes_per_token(48, 8, 128) == 48 * 8 * 1 == 384
    plain = memory_budget(qwen, 2, torch.device("cpu"), 1, device_bytes=80 << 30)
    rec = memory_budget(qwen, 2, torch.device("cpu"), 1, device_bytes=80 << 30, record_routes=True)
    assert plain.route_bytes_per_token == 0 and rec.route_bytes_per_token == 384
    assert rec.kv_bytes_per_token == kv_bytes_per_token(qwen, 2) + 384 == plain.kv_bytes_per_token + 384
    assert "384 B recorded routes" in rec.describe(8)


def test_engine_records_every_position_and_float64_replay_changes_nothing():
    model = _model(TINY, torch.float64)
    engine, routes = _generate(model)
    for r in engine.finished:
        assert routes[r.key].shape == (len(r.prompt) + len(r.tokens) - 1, 2, 2)
        assert routes[r.key].dtype == torch.uint8
    off, rep, gap = _training_forward(model, engine, routes, replay=False)
    assert float(rep.pairs[1]) == float(rep.pairs[0]) > 0  # float64: the same choices everywhere
    on, _, _ = _training_forward(model, engine, routes, replay=True)
    assert torch.equal(on, off)  # bit for bit where no route ties
    kv = engine.cache.nbytes  # a detached rank's lease gets the route buffer with the KV cache
    assert engine.release_memory() == kv + (3 + 1) * 40 * 2 * 2
    engine.reclaim_memory()
    assert engine.recorder.sink.buf_RLK.shape == ((3 + 1) * 40, 2, 2)


def test_a_paged_cache_records_the_slot_caches_routes_also_for_a_shared_group_prefix():
    # Three samples of one prompt and one other: the paged cache prefills the group once and the
    # other samples take its pages (fork), so their prompt's routes are copied, not computed.
    def group():
        return [Request(f"p{i // 3}", i % 3, [1 + (5 * (i // 3) + j) % 17 for j in range(5)], 12, fixed_len=12)
                for i in range(4)]

    model = _model(TINY, torch.float64)
    slots, want = _generate(model, requests=group())
    paged, got = _generate(model, requests=group(), kv=PagedKV(page_size=4))
    report = paged.kv_report()
    assert report["prefill_tokens_computed"] < report["prefill_tokens_requested"]  # the prefix was shared
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_bf16_replay_uses_the_recorded_routes_and_narrows_the_gap(monkeypatch):
    model = _model(WIDE, torch.bfloat16, seed=2)
    engine, routes = _generate(model, greedy=False)
    _, rep, gap_off = _training_forward(model, engine, routes, replay=False)
    agreement = float(rep.pairs[1] / rep.pairs[0])
    used = []
    real = RouteReplay.route

    def spy(self, layer, own_TK):
        out = real(self, layer, own_TK)
        used.append((out, self.routes_TLK[:, layer].long(), self.has_T))
        return out

    monkeypatch.setattr(RouteReplay, "route", spy)
    _, _, gap_on = _training_forward(model, engine, routes, replay=True)
    for out, target, has in used:
        assert torch.equal(out[has], target[has])  # by construction
    assert agreement < 1 and gap_on < gap_off, (agreement, gap_off, gap_on)


def test_routes_travel_with_a_migrated_request():
    from megatron_rl.rollout.elastic_engines.torch_engine import MigratingRolloutEngine

    model = _model(TINY, torch.float64)
    _, want = _generate(model)

    def engine():
        e = RecordingEngine(model, SamplingParams(greedy=True, seed=1), 3, 40, temperature=1.0)
        m = MigratingRolloutEngine(e, 1, carried=CarriedValues(e))
        m.use_group(None, {x: 0 for x in range(TINY.num_moe_experts)})
        e.recorder.start({})
        return m

    src, dst = engine(), engine()
    src.engine.add(_requests())
    for _ in range(5):
        src.step()
    header, ids, kv = src.export_request(("p0", 0))
    dst.import_request(("p0", 0), header, ids.clone(), kv.clone())
    src.release_request(("p0", 0))
    for m in (src, dst):
        while m.engine.has_work():
            m.step()
    got = {**src.engine.recorder.routes([]), **dst.engine.recorder.routes([])}
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _pool_with_carried(n_tokens=3, prompt_len=4):
    from elastic.planning.partial import Carried, CarryPool, PartialRule, PendingGroup

    pool = CarryPool(PartialRule(), 2, 1)
    s = Carried("p", 0, prompt_len, 7, n_tokens, False, [(1, n_tokens)], [1] * n_tokens, [-0.5] * n_tokens)
    pool.pending = [PendingGroup(0, "p", {"index": 0, "epoch": 0}, [s, Carried("p", 1, prompt_len, 8)])]
    return pool


def test_carried_routes_load_checked():
    from megatron_rl.errors import CheckpointError
    from megatron_rl.rl.checkpoint.route_state import load_routes

    pool = _pool_with_carried()
    routes = torch.rand(4 + 3 - 1, 2, 8).argsort(-1)[..., :2].to(torch.uint8)  # top-2 of 8: distinct ids
    got = load_routes([["p", 7, encode(routes)]], pool, TINY, "ck/trainer_state.json")
    assert torch.equal(got[("p", 7)], routes)
    bad = routes.clone()
    bad[2, 1, 0] = 8  # an expert id >= the expert count
    with pytest.raises(CheckpointError, match=r"^ck/trainer_state.json: field partial.routes\[0\]: expert id 8"):
        load_routes([["p", 7, encode(bad)]], pool, TINY, "ck/trainer_state.json")
    repeated = torch.tensor([[0, 1], [2, 3]], dtype=torch.uint8).expand(6, 2, 2).clone()
    assert torch.equal(load_routes([["p", 7, encode(repeated)]], pool, TINY, "ck")[("p", 7)], repeated)
    repeated[4, 1] = 5  # a token's top-2 ids the same expert (a checkpoint edited, checksum redone)
    with pytest.raises(CheckpointError, match=r"^ck: field partial.routes\[0\]: position 4, layer 1: top-k expert "
                                              r"ids \[5, 5\] repeat"):
        load_routes([["p", 7, encode(repeated)]], pool, TINY, "ck")
    with pytest.raises(CheckpointError, match=r"field partial.routes\[0\]: expected 6 positions of routes "
                                              r"\(prompt 4 \+ 3 tokens - 1\), got 5"):
        load_routes([["p", 7, encode(routes[:5])]], pool, TINY, "ck/trainer_state.json")
    with pytest.raises(CheckpointError, match=r"field partial.routes\[0\]: response \('p', 9\) is not pending"):
        load_routes([["p", 9, encode(routes)]], pool, TINY, "ck/trainer_state.json")


def test_masked_importance_sampling():
    from megatron_rl.rl.update.grpo import mis_keep

    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    roll = torch.tensor([[0.0, 1.0, -0.05], [0.1, 0.1, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    tok = mis_keep(old, roll, mask, (0.5, 2.0), "token")
    assert tok.tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]  # exp(-1) < 0.5: dropped
    seq = mis_keep(old, roll, mask, (0.85, 2.0), "sequence")
    assert seq.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]  # exp(-0.2) < 0.85: the whole response


def test_config_fields():
    from megatron_rl.config import ConfigError
    from megatron_rl.trainer_config import GRPOConfig

    assert GRPOConfig(mis_bounds=[0.5, 2]).mis_bounds == (0.5, 2.0)
    for bad in ([0, 2], [2, 0.5], [0.5]):
        with pytest.raises(ConfigError, match="grpo.mis_bounds"):
            GRPOConfig(mis_bounds=bad)
    with pytest.raises(ConfigError, match="grpo.mis_level"):
        GRPOConfig(mis_level="batch")
