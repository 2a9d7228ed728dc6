"""The rollout policies, named once: the CLI's choices, the configs' fields and the simulator read them here.

- `vanilla`: one stage, nobody leaves; `lengthsort`: responses sorted by predicted length, nobody leaves;
- `natural` / `planned`: the EP group shrinks to the floor (in arrival order / on predicted lengths);
- `adaptive`: planned, then the online rule re-predicts, re-plans and migrates stragglers.
"""
POLICIES = ("vanilla", "lengthsort", "natural", "planned", "adaptive")
# The simulator can also replay `oracle`: planned on the true lengths, a bound beside the policies.
SIM_POLICIES = ("vanilla", "lengthsort", "natural", "planned", "oracle", "adaptive")
