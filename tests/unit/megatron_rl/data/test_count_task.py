"""The length-tailed counting task and its example config agree: the shipped data has the tail the
elastic rollout cuts (>= 30x between a batch's shortest and longest response), the answers are right,
the held-out set is disjoint, and the config's tokenizer and lengths hold every problem."""
import json

import pytest

from megatron_rl.config import load_dataclass
from megatron_rl.data.count import ALPHABET, make_count_problems
from megatron_rl.errors import FlexFloorError
from megatron_rl.trainer_config import TrainerConfig
from tests.helpers import REPO as ROOT


def _rows(path):
    return [json.loads(line) for line in (ROOT / path).read_text().splitlines() if line.strip()]


def test_problems_are_distinct_right_and_tailed():
    rows = make_count_problems(64, seed=0)
    assert len({r["prompt"] for r in rows}) == 64
    for r in rows:
        a, b = map(int, r["prompt"][:-1].split(","))
        assert a < b and r["answer"].split() == [str(x) for x in range(a, b + 1)]
    lengths = [len(r["answer"]) + 1 for r in rows]  # + EOS
    assert max(lengths) >= 30 * min(lengths)
    assert sorted(lengths)[len(lengths) // 2] <= 20  # most are short: the long ones are a tail


def test_heldout_is_disjoint_and_bad_spans_are_refused():
    train = make_count_problems(16, seed=0, max_value=20, max_span=8)
    held = make_count_problems(16, seed=1, max_value=20, max_span=8, exclude={r["prompt"] for r in train})
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    with pytest.raises(FlexFloorError, match="max_span"):
        make_count_problems(4, seed=0, max_value=10, max_span=20)


def test_the_example_holds_its_data():
    cfg = load_dataclass(TrainerConfig, ROOT / "examples" / "tiny_cpu_tailed.yaml")
    assert cfg.tokenizer.alphabet == ALPHABET and cfg.model.vocab_size == 3 + len(ALPHABET)
    train, held = _rows(cfg.data.path), _rows(cfg.eval.path)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    longest = max(len(r["answer"]) + 1 for r in train + held)
    assert longest <= cfg.generation.max_response_len
    assert max(len(r["prompt"]) + 1 for r in train + held) + cfg.generation.max_response_len \
        <= cfg.model.max_position_embeddings
    lengths = [len(r["answer"]) + 1 for r in train]
    assert max(lengths) >= 30 * min(lengths)
