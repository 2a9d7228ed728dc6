"""What ends a `megatron_rl/` command without a traceback.

The input errors it raises are `InputError`s (elastic/errors.py, the one root, which the CLI catches
once): a mistake in what the user gave us (a config, a checkpoint, a flag), printed as its one-line
message alone with exit status 2. `Interrupted` is a signal that ended the run. Bugs stay ordinary
exceptions so their tracebacks reach us.
"""
from elastic.errors import InputError


class FlexFloorError(InputError):
    """An input error found in `megatron_rl/` (the kinds below narrow it; elastic/ raises its own)."""


class ConfigError(FlexFloorError):
    pass


class CheckpointError(FlexFloorError):
    """A checkpoint (ours or a HuggingFace one) that is missing, torn, unverified or not ours to trust."""


class Interrupted(BaseException):
    """A signal (SIGTERM, SIGINT, SIGUSR1) ended the run before it finished; the CLI exits 128 + signum.

    A BaseException, like KeyboardInterrupt: a rank's `except Exception` must not swallow it.
    """

    def __init__(self, signum: int, detail: str = ""):
        super().__init__(signum, detail)
        self.signum, self.detail = signum, detail

    def __str__(self) -> str:
        import signal

        return f"interrupted by {signal.Signals(self.signum).name}{self.detail}"
