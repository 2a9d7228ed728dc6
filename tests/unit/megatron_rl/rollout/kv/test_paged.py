"""The paged KV cache: its page allocator's invariants, and tokens bit-identical to the slot cache's
in float64 with group prefix sharing, preemption and migration."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from megatron_rl.rollout.decode_step import DecodeOptions
from megatron_rl.rollout.elastic_engines.torch_engine import MigratingRolloutEngine
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.kv.cache import KVLayout
from megatron_rl.rollout.kv.kind import PagedKV, kv_kind
from megatron_rl.rollout.kv.paged import PagedKVCache
from megatron_rl.rollout.kv.pages import PageAllocator, PoolExhausted
from megatron_rl.rollout.sampling import SamplingParams

# (op, sequence, count): 0 grows a sequence by `count` pages, 1 forks it into a new one (sharing its
# pages), 2 ends it.
OPS = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 7), st.integers(1, 4)), max_size=60)


@settings(max_examples=100, deadline=None)
@given(pages=st.integers(1, 12), ops=OPS)
def test_pages_are_owned_once_returned_on_release_and_shared_until_the_last_holder(pages, ops):
    pool = PageAllocator(pages)
    tables: dict[int, list[int]] = {}
    for op, seq, count in ops:
        if op == 0:
            table = tables.setdefault(seq, [])
            for _ in range(count):
                if not pool.free:
                    with pytest.raises(PoolExhausted):
                        pool.alloc()
                    break
                table.append(pool.alloc())
        elif op == 1 and seq in tables:
            tables[max(tables) + 1] = [pool.share(p) for p in tables[seq]]
        elif op == 2 and seq in tables:
            for p in tables.pop(seq):
                pool.release(p)
        holders = [p for t in tables.values() for p in t]
        # A page is free or held, never both; each held page's count is its holders'.
        assert set(pool.free).isdisjoint(holders) and len(set(pool.free)) == len(pool.free)
        assert all(pool.refs[p] == holders.count(p) for p in range(pages))
        # A page no sequence grew twice: within one table every page appears once.
        assert all(len(set(t)) == len(t) for t in tables.values())
        assert len(pool.free) + len(set(holders)) == pages
    for t in tables.values():
        for p in t:
            pool.release(p)
    assert sorted(pool.free) == list(range(pages))
    with pytest.raises(RuntimeError):
        pool.release(0)


@pytest.fixture(scope="module")
def model():
    m = Qwen3MoeModel(MoEModelConfig(), dtype=torch.float64)
    m.init_weights(0)
    return m.eval()


SAMPLING = SamplingParams(greedy=False, temperature=0.9, top_p=0.9, seed=3)


def group_requests(predicted_len=None):
    """Three GRPO groups of three samples with prompts of 3, 6 and 9 tokens and tailed lengths."""
    out = []
    for i in range(3):
        prompt = torch.randint(0, 256, (3 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist()
        out += [Request(f"p{i}", s, prompt, 40, fixed_len=3 + 5 * ((i + s) % 3), predicted_len=predicted_len)
                for s in range(3)]
    return out


def run(engine, reqs):
    engine.add(reqs)
    while engine.has_work():
        engine.step()
    return {r.key: r.tokens for r in engine.finished}


@pytest.mark.parametrize("pad", [False, True])
def test_paged_tokens_equal_slots_and_the_group_prefills_once(model, pad):
    want = run(RolloutEngine(model, SAMPLING, 9, 32), group_requests())
    # `pad`: decode buckets' padding rows write the scratch page, as CUDA graphs would.
    paged = RolloutEngine(model, SAMPLING, 9, 32, kv=PagedKV(page_size=4), decode=DecodeOptions(pad=pad))
    assert run(paged, group_requests()) == want
    report = paged.kv_report()
    assert report["prefill_tokens_requested"] == 3 * (3 + 6 + 9)
    assert report["prefill_tokens_computed"] == 3 + 6 + 9  # one prefill per prompt
    assert report["pages_shared"] == 2 * (0 + 1 + 2)  # the full prompt pages of the two other samples
    assert paged.cache.pool.used == 0 and sorted(paged.cache.pool.free) == list(range(paged.cache.pool.pages))


def test_pool_exhaustion_preempts_the_newest_and_recomputes_identically(model):
    want = run(RolloutEngine(model, SAMPLING, 9, 32), group_requests())
    # Predictions far too short and no reserve: admission overcommits, decode runs out of pages.
    paged = RolloutEngine(model, SAMPLING, 9, 32, kv=PagedKV(page_size=4, pages=10, reserve=0.0))
    assert run(paged, group_requests(predicted_len=1)) == want
    assert paged.kv_report()["preemptions"] > 0 and len(paged.finished) == 9
    assert paged.cache.peak_pages <= 10


def test_a_request_longer_than_the_pool_is_refused(model):
    paged = RolloutEngine(model, SAMPLING, 4, 64, kv=PagedKV(page_size=4, pages=3))
    with pytest.raises(ValueError, match="needs 15 positions, the KV cache has 12"):
        paged.add([Request("long", 0, [1, 2, 3], 20, fixed_len=12)])


@pytest.mark.parametrize("kinds", [("paged", "paged"), ("slots", "paged"), ("paged", "slots")])
def test_a_migrated_request_with_shared_pages_continues_identically(model, kinds):
    def engine(kv):
        e = MigratingRolloutEngine(RolloutEngine(model, SAMPLING, 9, 32, kv=kv_kind(kv, page_size=4)), 1)
        e.use_group(None, {x: 0 for x in range(model.config.num_moe_experts)})
        return e

    want = run(RolloutEngine(model, SAMPLING, 9, 32), group_requests())
    src, dst = engine(kinds[0]), engine(kinds[1])
    src.engine.add(group_requests())
    for _ in range(3):
        src.step()
    key = ("p2", 0)  # shares two full prompt pages with its group on a paged sender
    dst.import_request(key, *src.export_request(key))
    src.release_request(key)
    for e in (src, dst):
        while e.engine.has_work():
            e.step()
    got = {r.key: r.tokens for e in (src, dst) for r in e.engine.finished}
    assert got == want


def test_a_migrated_request_keeps_its_prediction_and_waits_for_room_on_a_full_receiver(model):
    """The header carries `predicted_len`, and the receiver admits by its cache's own test: a paged
    receiver whose pages are promised to its live request queues the migrated one (it re-prefills
    its tokens so far when admitted, as a preempted request does) instead of overcommitting."""
    want = run(RolloutEngine(model, SAMPLING, 9, 32), group_requests())
    src = MigratingRolloutEngine(RolloutEngine(model, SAMPLING, 9, 32, kv=PagedKV(page_size=4)), 1)
    dst = MigratingRolloutEngine(RolloutEngine(model, SAMPLING, 9, 32, kv=PagedKV(page_size=4, pages=6, reserve=0.0)),
                                 1)
    for e in (src, dst):
        e.use_group(None, {x: 0 for x in range(model.config.num_moe_experts)})
    src.engine.add(group_requests(predicted_len=8))
    dst.engine.add([Request("q", 0, list(range(1, 9)), 40, fixed_len=12)])  # promised 5 of the 6 pages
    for _ in range(3):
        src.step()
    dst.step()
    key = ("p2", 0)  # 11 positions held, 17 predicted: 5 pages, where the receiver has 1 unpromised
    dst.import_request(key, *src.export_request(key))
    src.release_request(key)
    moved = next(r for r in dst.engine.pending + dst.engine.live if r.key == key)
    assert moved.predicted_len == 8 and moved in dst.engine.pending
    for e in (src, dst):
        while e.engine.has_work():
            e.step()
    got = {r.key: r.tokens for e in (src, dst) for r in e.engine.finished if r.key != ("q", 0)}
    assert got == want and dst.engine.cache.peak_pages <= 6


def test_carried_over_responses_reprefill_beside_their_fresh_siblings(model):
    """Partial carry-over: a resumed response comes back as prompt + its tokens so far (as
    rl/rollout_phase/phase.py builds it); it prefills on its own, its fresh siblings share their prompt."""
    def batch():
        reqs = group_requests()
        for r in reqs[1::2]:
            r.prompt = r.prompt + [7 + r.sample, 11]  # two tokens carried over from the last step
        return reqs

    want = run(RolloutEngine(model, SAMPLING, 9, 32), batch())
    paged = RolloutEngine(model, SAMPLING, 9, 32, kv=PagedKV(page_size=4))
    assert run(paged, batch()) == want
    report = paged.kv_report()
    assert report["prefill_tokens_computed"] < report["prefill_tokens_requested"] and report["pages_shared"] > 0


def test_a_detached_rank_frees_the_pool_and_reclaims_it_zeroed():
    cache = PagedKVCache(KVLayout(2, 2, 8, torch.float64), 4, 16, pages=6, page_size=4)  # and the scratch page
    per = 2 * 2 * 7 * 2 * 4 * 8 * 8
    assert cache.nbytes == per
    s = cache.alloc()
    cache.commit(cache.prefill_batch([s], [5]))
    assert cache.pool.used == 2
    with pytest.raises(RuntimeError, match="1 live sequences"):
        cache.release_memory()
    cache.release(s)
    assert cache.pool.used == 0 and cache.release_memory() == per and cache.nbytes == 0
    cache.reclaim_memory()
    assert cache.nbytes == per and all(int(t.count_nonzero()) == 0 for t in cache.k)


def test_admission_counts_a_groups_shared_prompt_pages_once():
    cache = PagedKVCache(KVLayout(1, 1, 2, torch.float64), 4, 16, pages=6, page_size=4, reserve=0.0)
    # Three samples of an 8-token prompt predicted to end at 12 positions: 3 pages alone, 1 more
    # each for the samples that share the prompt's two full pages.
    assert cache.admissible([8, 8, 8], [12, 12, 12], 0, [0, 8, 8]) == 3
    assert cache.admissible([8, 8, 8], [12, 12, 12], 0, [0, 0, 0]) == 2


def test_a_pool_of_the_slots_bytes_admits_every_slot_whatever_the_reserve():
    """The default pool (the slots' bytes) holds every sequence at max_len: requests predicted to
    reach their cap all start at once, as in the slot cache (with a 10% reserve, 7 of 8 did and
    the eighth decoded alone afterwards, doubling the decode steps)."""
    mcfg = MoEModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_query_groups=1)
    layout = KVLayout.of(mcfg, torch.float64, "cpu")
    cache = PagedKV(page_size=16, reserve=0.1).cache(layout, 8, 64)
    assert cache.admissible([16] * 8, [64] * 8, 0, [0] * 8) == 8
    # A pool of 24 pages holds 6 such sequences at max_len (4 pages each): 6 start (5 did).
    small = PagedKV(page_size=16, pages=24, reserve=0.1).cache(layout, 8, 64)
    assert small.admissible([16] * 8, [64] * 8, 0, [0] * 8) == 6
