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
    _parse, *rest = ma._math_verify()  # imported at the first verification (math_answer.py)
    monkeypatch.setattr(ma, "_math_verify", lambda: (lambda *a, **k: [], *rest))
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


def test_math_verify_is_imported_at_the_first_verification_not_with_the_rewards():
    """The engine's imports reach the rewards (rollout/config.py -> lease_jobs -> sidecar.py), and the
    bare GPU image lacks math-verify: importing the rewards must not import it."""
    import subprocess
    import sys

    code = ("import sys; import megatron_rl.rewards, megatron_rl.rollout.config, megatron_rl.trainer_config; "
            "print('math_verify' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip() == "False"
