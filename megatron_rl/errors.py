"""User-facing errors.

A `FlexFloorError` is a mistake in what the user gave us (a config, a trace, a checkpoint, a flag):
the CLI prints its message alone and exits non-zero, without a traceback. Bugs stay ordinary
exceptions so their tracebacks reach us.
"""


class FlexFloorError(Exception):
    """An error in user input; the message must say where (file, field, line) and what was expected."""


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
