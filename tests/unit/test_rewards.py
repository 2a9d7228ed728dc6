import megatron_rl.rewards.math_answer as ma
from megatron_rl.rewards import RewardConfig, Scorer


def test_exact_reward_counts_outcomes():
    s = Scorer(RewardConfig(kind="exact"))
    assert [s("19", "19"), s(" 19 ", "19"), s("18", "19"), s("", "19"), s("1", None)] == [1, 1, 0, 0, 0]
    assert s.take_counts() == {"correct": 2, "wrong": 1, "unparsable": 1, "no_reference": 1, "scored": 0,
                               "error": 0}
    assert s.take_counts()["correct"] == 0


def test_math_verifier_via_math_verify():
    assert ma.verify_math("The answer is \\boxed{\\frac{1}{2}}", "0.5") == "correct"
    assert ma.verify_math("so it is 18", "19") == "wrong"
    assert ma.verify_math("I cannot say", "19") == "unparsable"
    assert ma.verify_math("12", "") == "no_reference"


def test_sympy_fallback_when_math_verify_finds_nothing(monkeypatch):
    monkeypatch.setattr(ma, "parse", lambda *a, **k: [])
    ma._parse_gold.cache_clear()
    try:
        assert ma.verify_math("first 3 then \\boxed{6/4}", "\\frac{3}{2}") == "correct"
        assert ma.verify_math("about 1,000 apples", "1000") == "correct"
        assert ma.verify_math("it is 7", "8") == "wrong"
        # Never evaluate arbitrary text: names and powers are not parsed, they are unparsable.
        assert ma.verify_math("\\boxed{__import__('os')}", "1") == "unparsable"
        assert ma.verify_math("\\boxed{9**9**9}", "1") == "unparsable"
        assert ma.verify_math("12", "twelve") == "no_reference"
    finally:
        ma._parse_gold.cache_clear()


def test_math_scorer_never_raises_on_garbage():
    s = Scorer(RewardConfig(kind="math", unparsable_reward=-0.1))
    rewards = [s(r, "4") for r in ["\\boxed{", "}{}{", "\x00\x01", "$$$", "\\frac{", "4"]]
    assert rewards[-1] == 1.0 and all(r in (0.0, -0.1) for r in rewards[:-1])
    counts = s.take_counts()
    assert sum(counts.values()) == 6 and counts["correct"] == 1
