"""User files: Python a config names, loaded by one function under one trust rule.

**The trust rule.** A user file (a reward function now; an algorithm, a tool later) runs because the
user's config names it, and by no other route. `load_user_function` imports it from the path of a
config field (`reward.path`), by that path alone: no folder is added to the import path, no module
name is registered where another import could find it, and nothing a run reads (a checkpoint, a run
folder, a dataset row) can name a file to run. It runs with the run's rights: it is the user's own
code, not a sandbox boundary (the chat template, which is data, is rendered in a sandbox).

**Where it runs** is decided by its kind (`kinds.py`; rewards: `reward_kind.py`):
  - contained (rewards; tools later): in worker processes the run owns (`pool.py` starts them,
    `worker.py` is their main). A chdir, an environment change, a leaked thread or a hang stays in
    the worker; a call past its bound is ended with its worker, which is replaced; and what a call
    returns is judged in the worker and comes back as JSON, so no user object reaches the run.
  - in-process (algorithms, which need autograd): `load_user_function` in the rank itself.
Either way the import and every call are judged inside a guard that catches `BaseException`: a
`sys.exit` or `KeyboardInterrupt` of user code is that code's failure, reported in one line.
"""
from megatron_rl.user_code.kinds import UserCodeKind
from megatron_rl.user_code.loader import UserFile, load_user_function
from megatron_rl.user_code.reward_kind import REWARD

__all__ = ["REWARD", "UserCodeKind", "UserFile", "load_user_function"]
