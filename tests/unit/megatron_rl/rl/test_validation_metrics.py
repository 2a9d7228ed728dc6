"""verl's validation names per data source: val-core/<source>/reward/{mean@N, best@N/mean, maj@N/mean}."""
from megatron_rl.data.prompts import Prompt
from megatron_rl.metrics.keys import grouped
from megatron_rl.rl.validation import summarize


def _row(index, rewards, texts):
    return {"index": index, "rewards": rewards, "correct": [r == 1.0 for r in rewards],
            "lengths": [2] * len(rewards), "texts": texts}


def test_mean_best_and_majority_per_source():
    prompts = [Prompt("a", "1+1=", "2", data_source="gsm8k"), Prompt("b", "2+2=", "4", data_source="gsm8k"),
               Prompt("c", "x", "y", data_source="math")]
    rows = [_row(0, [1.0, 0.0, 0.0], ["2", "3", "3"]),   # majority "3" is wrong; best is right
            _row(1, [1.0, 1.0, 0.0], ["4", " 4", "5"]),  # majority "4" (stripped) is right
            _row(2, [0.0, 0.5, 0.0], ["p", "q", "r"])]   # a three-way tie: the first answer
    out = grouped(summarize(rows, prompts, 3))
    assert out["val-core/gsm8k/reward/mean@3"] == 0.5
    assert out["val-core/gsm8k/reward/best@3/mean"] == 1.0
    assert out["val-core/gsm8k/reward/maj@3/mean"] == 0.5
    assert (out["val-core/math/reward/mean@3"], out["val-core/math/reward/best@3/mean"],
            out["val-core/math/reward/maj@3/mean"]) == (0.5 / 3, 0.5, 0.0)
    assert out["val/pass@1"] == 3 / 9 and out["val/prompts"] == 3
