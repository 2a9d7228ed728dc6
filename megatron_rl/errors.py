"""User-facing errors.

A `FlexFloorError` is a mistake in what the user gave us (a config, a trace, a checkpoint, a flag):
the CLI prints its message alone and exits non-zero, without a traceback. Bugs stay ordinary
exceptions so their tracebacks reach us.
"""


class FlexFloorError(Exception):
    """An error in user input; the message must say where (file, field, line) and what was expected."""


class ConfigError(FlexFloorError):
    pass
