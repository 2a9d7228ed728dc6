"""The sampled future a decision is priced on: `Grid.per_rank` against a count made request by request."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.planning.online.grid import Grid


def _by_request(grid: Grid, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, segment and rank: the requests whose key rank * span + remainder is past the
    rank's query at the segment's middle (the comparison `per_rank`'s search makes), and their KV."""
    S, K = grid.seg.shape
    count, kv = np.zeros((S, K, grid.world)), np.zeros((S, K, grid.world))
    key = ranks[None, :] * grid.span + grid.rem  # (S, n)
    for w in range(grid.world):
        for k in range(K):
            alive = (ranks == w)[None, :] & (key > w * grid.span + grid.mid[k])
            count[:, k, w] = alive.sum(axis=1)
            kv[:, k, w] = (alive * grid.held[None, :]).sum(axis=1) + count[:, k, w] * grid.mid[k]
    return count, kv


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_per_rank_counts_every_request_alive_at_each_segment(data):
    world = data.draw(st.integers(1, 9))
    samples, n = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 40))
    top = data.draw(st.sampled_from([1, 3, 17, 300, 5000]))
    rem = np.array(data.draw(st.lists(st.integers(1, top), min_size=samples * n, max_size=samples * n)),
                   float).reshape(samples, n)
    held = np.array(data.draw(st.lists(st.integers(1, 4000), min_size=n, max_size=n)), float)
    ranks = np.array(data.draw(st.lists(st.integers(0, world - 1), min_size=n, max_size=n)))
    grid = Grid(rem, held, ranks, world, data.draw(st.sampled_from([1, 2, 16])))
    other = np.array(data.draw(st.lists(st.integers(0, world - 1), min_size=n, max_size=n)))
    for layout in (ranks, other):
        count, kv = grid.per_rank(layout)
        want_count, want_kv = _by_request(grid, layout)
        assert np.array_equal(count, want_count)
        assert np.array_equal(kv, want_kv)  # whole KV tokens: every order of summing them is exact
