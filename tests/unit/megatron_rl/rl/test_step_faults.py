"""A failed collective in a training step is one line naming the rank, the step and the phase that
was in flight when it failed (from the `StepPhases` the step passes); a bug keeps its traceback."""
import pytest

from megatron_rl.rl.step_faults import StepFault, StepPhases, step_faults


def test_a_failed_collective_names_the_phase_in_flight_and_the_phases_are_timed():
    phases = StepPhases("rollout")
    with pytest.raises(StepFault) as e:
        with step_faults(3, 7, 2.5, phases):
            phases.start("reward")
            phases.start("update")
            raise RuntimeError("[gloo] Connection reset by peer")
    assert str(e.value) == ("rank 3, step 7, phase update: Connection reset by peer "
                            "(timeout_s 2.5; a peer rank froze, died or is slower)")
    assert list(phases.seconds) == ["rollout", "reward"] and min(phases.seconds.values()) >= 0
    phases.end()
    assert list(phases.seconds) == ["rollout", "reward", "update"]


def test_a_bug_keeps_its_traceback():
    with pytest.raises(RuntimeError, match="^shapes do not match$"):
        with step_faults(0, 1, 300.0, StepPhases("checkpoint")):
            raise RuntimeError("shapes do not match")
