"""The main of a user-code worker process: `pool.py` starts it; the run never imports it.

It loads one user file (`load_user_function`), answers whether that worked, then serves calls until
the run closes its pipe: a call's arguments arrive pickled; what the function returned goes back
as its kind's plain data (`kinds.py`), or the call's failure in a few words. User code shares this
process, so this module imports nothing heavy, and no failure of a call ends the loop.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import sys

from megatron_rl.errors import ConfigError
from megatron_rl.parallel.signals import die_with_parent
from megatron_rl.user_code import frames
from megatron_rl.user_code.kinds import BadReturn
from megatron_rl.user_code.loader import UserFile, failure, load_user_function
from megatron_rl.user_code.reward_kind import REWARD

KINDS = {kind.section: kind for kind in (REWARD,)}  # the contained kinds, by the name the pool sends


def main() -> None:
    """argv: the run's `sys.path` (JSON, set by the bootstrap), the request and reply pipes, the
    run's pid."""
    requests, replies, parent = (int(a) for a in sys.argv[2:5])
    # A Ctrl+C reaches the whole process group; the launcher turns it into a stop of the ranks,
    # which then end this worker. It is not a failure of the call in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # End with the run, even in a call that never returns to Python: the kernel kills this process
    # when the pool's spawner thread, which lives as long as the run's process, ends.
    if not die_with_parent(parent):
        os._exit(1)
    start = pickle.loads(frames.receive(requests))
    kind = KINDS[start["kind"]]
    try:
        fn = load_user_function(UserFile(kind, start["path"], start["name"]))
    except ConfigError as e:
        _reply(replies, {"error": str(e)})
        os._exit(0)
    _reply(replies, {"ready": True})
    while True:
        try:
            args = pickle.loads(frames.receive(requests))
        except frames.Closed:  # the run is done with this worker
            os._exit(0)
        _reply(replies, _call(kind, fn, args))


def _call(kind, fn, args) -> dict:
    try:
        value = fn(*args)
    except BaseException as e:  # the user's code: any failure is the call's outcome  # noqa: BLE001
        return {"error": failure(e)}
    try:
        return {"value": kind.result(value)}
    except BadReturn as e:
        return {"error": str(e)}
    except BaseException as e:  # the returned object's own methods (__float__, item, keys)  # noqa: BLE001
        return {"error": f"reading what it returned raised {failure(e)}"}


def _reply(fd: int, message: dict) -> None:
    frames.send(fd, json.dumps(message).encode())
