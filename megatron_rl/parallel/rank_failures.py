"""What a failed rank reports, and the one line that names a failed job's cause.

A rank that raises reports a `RankFailure`: its exception's type and message (one line for an
expected failure, the traceback for a bug), whether it is a collective's reaction to a peer's death
rather than a cause of its own, and the full disk behind it, if any (parallel/disk_full.py). When
one rank fails, the collectives of the others fail too: gloo's "Connection closed by peer ... This
is typically caused by a remote worker crashing ... GLHF!", a timeout, NCCL's aborted communicator;
on a loaded machine those reports may arrive first. `describe` names the cause, in this order: a
rank that died without a report (a signal, the OOM killer: its peers react), a rank whose exception
is its own (a user error, a bug), and only then a reaction; then what one other rank said. A long
traceback is cut in its middle, so the line always keeps the exception's own last line.
"""
from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from pathlib import Path

from elastic.errors import InputError, shorten
from elastic.runtime.runtime import ElasticFault
from megatron_rl.errors import Interrupted
from megatron_rl.parallel.disk_full import DiskFull, disk_full

# What a collective raises on a rank whose peer died, froze or left: gloo's lost connection and its
# advice, a socket or store timeout, NCCL's communicator aborted by its watchdog or a remote error.
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|remote worker|Broken pipe|[Tt]imed out|Timeout|"
                        r"NCCL communicator was aborted|ncclRemoteError|remote process exited")
# Characters of the cause's message, and of another rank's last line, in the one line (the CLI
# prints up to 2000).
CAUSE_CHARS = 1500
CONTEXT_CHARS = 300


@dataclass(frozen=True)
class RankFailure:
    rank: int
    kind: str  # the exception's type name; "died" for a rank that ended without a report
    message: str  # one line, a traceback (a bug), or "exit code N" (died)
    reaction: bool = False  # a collective's reaction to a peer's death or freeze, not a cause
    disk_full: DiskFull | None = None


def user_error(e: BaseException) -> InputError | None:
    """The user's mistake behind `e`, if any: the runtime wraps what a rank raises (`ElasticFault`
    names rank, stage and phase), so an `InputError` may sit in the cause chain."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, InputError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def peer_reaction(e: BaseException) -> bool:
    """True when `e` comes from a collective that failed because a peer died or froze: its root
    (the innermost exception of its chain; the runtime's ElasticFault and the trainer's StepFault
    wrap it) says so. A root of another kind is this rank's own failure, even when a peer's death
    followed it."""
    seen = set()
    while id(e) not in seen and (e.__cause__ or e.__context__) is not None:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return isinstance(e, RuntimeError) and _PEER_GONE.search(str(e)) is not None


def failure_of(e: BaseException, rank: int, writes_to: str | Path | None) -> RankFailure:
    """What rank `rank` reports of `e`: a full disk as one line naming it, an expected failure (a
    user error even when the runtime wrapped it, a fault, a signal) as its one-line message, a bug
    with its traceback."""
    full = disk_full(e, writes_to)
    if full is not None:
        return RankFailure(rank, "DiskFull", str(full), disk_full=full)
    user = user_error(e)
    if user is not None:
        return RankFailure(rank, type(user).__name__, str(user))
    one_line = isinstance(e, (ElasticFault, Interrupted)) or getattr(e, "one_line", False)
    message = str(e) if one_line else "".join(traceback.format_exception(e))
    return RankFailure(rank, type(e).__name__, message, reaction=peer_reaction(e))


def describe(failures: list[RankFailure]) -> str:
    """One line: the cause first (a death, else a failure of a rank's own, else the first), then
    the ranks that said the same, then what one other rank said."""
    deaths = [f for f in failures if f.kind == "died"]
    own = [f for f in failures if f.kind != "died" and not f.reaction]
    cause = (deaths or own or failures)[0]
    if cause.kind == "died":
        text = f"rank {cause.rank} died ({cause.message})"
    else:
        text = f"rank {cause.rank} failed: {clipped(cause.message, CAUSE_CHARS)}"
    context = [f for f in failures if f is not cause and f.kind != "died"]
    # Ranks that hit the same error (a shared checkpoint file, a config every rank reads) are
    # named, not repeated: the message stays one short line.
    alike = [f.rank for f in context if f.message.strip() == cause.message.strip()]
    if alike:
        text += f" (rank{'s' if len(alike) > 1 else ''} {', '.join(map(str, alike))} alike)"
    context = [f for f in context if f.rank not in alike]
    if context:
        last = context[0].message.strip().splitlines()[-1] if context[0].message.strip() else context[0].kind
        text += f"; rank {context[0].rank} reported: {shorten(last, CONTEXT_CHARS)}"
    return text


def clipped(text: str, limit: int) -> str:
    """`text` in at most about `limit` characters: cut in its middle (a traceback's outer frames),
    keeping its first line and its end, so the exception's own last line (type and message) stays."""
    text = text.strip()
    if len(text) <= limit:
        return text
    lines = text.splitlines()
    last = lines[-1]
    if len(last) >= limit // 2:  # an exception whose own line is long: that line, shortened
        return shorten(last, limit)
    head = lines[0][: limit // 4]
    tail = text[-(limit - len(head) - 40):]
    return f"{head} ... ({len(text) - len(head) - len(tail)} characters cut) ... {tail}"
