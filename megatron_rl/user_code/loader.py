"""The one loader of user files (the trust rule is in this package's docstring)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from elastic.errors import shorten
from megatron_rl.errors import ConfigError
from megatron_rl.user_code.kinds import UserCodeKind


@dataclass(frozen=True)
class UserFile:
    """Function `name` of the Python file `path`, which the config's `<kind.section>` names."""

    kind: UserCodeKind
    path: str
    name: str

    @property
    def label(self) -> str:
        """How messages name it: `my_reward.py:compute_score`."""
        return f"{self.path}:{self.name}"


def failure(e: BaseException) -> str:
    """What user code raised, in a few words: `ValueError: bad response`, `SystemExit: 0`."""
    text = shorten(e)
    return type(e).__name__ if text == type(e).__name__ else f"{type(e).__name__}: {text}"


def load_user_function(file: UserFile) -> Callable[..., Any]:
    """`file.name` from `file.path`, imported in this process; one line naming the field when the
    file is not there, is not Python, fails at import (`BaseException` included: a `sys.exit` at
    import is the file's failure, not the run's exit) or defines no such function."""
    section, path = file.kind.section, Path(file.path)
    if not path.is_file():
        raise ConfigError(f"{section}.path {file.path}: no such file (a Python file defining {file.name})")
    spec = importlib.util.spec_from_file_location(f"flexfloor_{section}_{path.stem}", path)
    if spec is None:  # a suffix no import loader reads
        raise ConfigError(f"{section}.path {file.path}: not a Python file (expected a .py file "
                          f"defining {file.name})")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        fn = getattr(module, file.name, None)  # a module-level __getattr__ is the user's code too
    except BaseException as e:  # the user's module failed at import, however  # noqa: BLE001
        raise ConfigError(f"{section}.path {file.path}: importing it failed ({failure(e)})") from None
    if not callable(fn):
        raise ConfigError(f"{section}.name {file.name}: {file.path} defines no function of that name")
    return fn
