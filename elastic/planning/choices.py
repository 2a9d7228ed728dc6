"""The names a command or a config may choose for the planner's layout and its chain objective.

Apart from the modules that define them (each layout in layout.py, `layout_kind`; each objective in
chains/search.py, `objective_key`), which import numpy and the planner: the CLIs' choices and their
configs' fields read the names here, so that `flexfloor --help` imports neither, and policies.py,
which imports the planner where a plan is made, is not tied to them.
"""

LAYOUTS = ("natural", "lengthsort", "planned")
OBJECTIVES = ("occupied", "rollout")
