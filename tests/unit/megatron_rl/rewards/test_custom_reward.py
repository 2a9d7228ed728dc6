"""A custom reward file with verl's compute_score signature: called with the right arguments, dict
returns logged as extras, raising / hanging / non-finite calls counted as errors (first printed
once), and the same rewards through a scoring lease as in the reward phase."""
import json

import pytest

from megatron_rl.data.prompts import Prompt
from megatron_rl.errors import ConfigError
from megatron_rl.rewards import RewardConfig, Scorer, Verdict, check_reward_file

REWARD_FILE = '''
import json, math, os, time
CALLS = os.path.join(os.path.dirname(__file__), "calls.jsonl")  # it runs in a worker process

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(CALLS, "a") as f:
        f.write(json.dumps([data_source, solution_str, ground_truth, extra_info]) + "\\n")
    if solution_str == "raise":
        raise ValueError("bad response")
    if solution_str == "hang":
        time.sleep(30)
    if solution_str == "nan":
        return math.nan
    if solution_str == "dict":
        return {"score": 0.5, "acc": 1.0, "pred": "x"}
    return float(solution_str.strip() == ground_truth)
'''


@pytest.fixture
def reward_cfg(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return RewardConfig(kind="custom", path=str(path), timeout_s=1, unparsable_reward=-1.0)


def test_called_with_verls_arguments_and_dict_extras(reward_cfg, tmp_path):
    s = Scorer(reward_cfg)
    p = Prompt("q1", "1+1=", "2", extra={"extra_info": {"index": 3}}, data_source="openai/gsm8k")
    assert s.credit(s.judge(" 2", p)) == 1.0 and s.credit(s.judge("3", p)) == 0.0
    assert s.credit(s.judge("dict", p)) == 0.5
    calls = [tuple(json.loads(line)) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls[0] == ("openai/gsm8k", " 2", "2", {"index": 3})
    assert s.take_counts()["scored"] == 3 and s.take_extras() == {"acc": (1.0, 1)}


def test_errors_and_hangs_are_counted_outcomes_printed_once(reward_cfg, capsys):
    s = Scorer(reward_cfg)
    rewards = [s("raise", "1"), s("hang", "1"), s("nan", "1"), s("1", "1")]
    assert rewards == [-1.0, -1.0, -1.0, 1.0]
    counts = s.take_counts()
    assert counts["error"] == 3 and counts["scored"] == 1
    err = capsys.readouterr().err
    assert err.count("[reward]") == 1 and "ValueError: bad response" in err


def test_same_rewards_through_a_scoring_lease(reward_cfg):
    from megatron_rl.data.tokenizer import CharTokenizer
    from megatron_rl.rl.rollout_phase.leases import TrainingLeases
    from megatron_rl.rollout.engine import Request
    from megatron_rl.trainer_config import TrainerConfig

    tok = CharTokenizer()
    prompts = [Prompt("a", "1+1=", "2", data_source="s"), Prompt("b", "2+2=", "4", data_source="s")]
    finished = [Request("a", 0, [], 4, tokens=tok.encode("2")[1:]), Request("b", 0, [], 4, tokens=tok.encode("5")[1:]),
                Request("b", 1, [], 4, tokens=tok.encode("4")[1:])]
    leases = TrainingLeases(TrainerConfig(reward=reward_cfg, ranks=2), tok, 0, 1).rollout(finished, prompts, False)
    leases.rewards.run(lambda: False)
    verdicts = leases.outcome().scored
    assert all(isinstance(v, Verdict) for v in verdicts.values())
    phase = Scorer(reward_cfg)
    direct = [phase(tok.decode(r.tokens), {"a": "2", "b": "4"}[r.prompt_id], "s") for r in finished]
    credited = [phase.credit(list(verdicts[r.key])) for r in finished]  # as a JSON list, too
    assert credited == direct == [1.0, 0.0, 1.0]


def test_a_reward_file_that_cannot_load_is_one_line(tmp_path):
    """(The driver's check, `check_reward_file`: the ranks' Scorers import the file in their workers.)"""
    with pytest.raises(ConfigError, match="reward.path .*nope.py: no such file"):
        check_reward_file(RewardConfig(kind="custom", path=str(tmp_path / "nope.py")))
    (tmp_path / "r.py").write_text("def other(): pass\n")
    with pytest.raises(ConfigError, match="reward.name compute_score: .* defines no function"):
        check_reward_file(RewardConfig(kind="custom", path=str(tmp_path / "r.py")))
    with pytest.raises(ConfigError, match="reward.path: needed by reward.kind custom"):
        RewardConfig(kind="custom")


def test_sources_route_to_built_in_verifiers():
    s = Scorer(RewardConfig(kind="exact", sources={"lighteval/MATH": "math"}))
    assert s("\\boxed{0.5}", "1/2", "lighteval/MATH") == 1.0
    assert s("\\boxed{0.5}", "1/2", "other") == 0.0
    with pytest.raises(ConfigError, match="reward.sources"):
        RewardConfig(sources={"x": "fuzzy"})
