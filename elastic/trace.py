"""Length traces: JSON Lines, one response per line (format in docs/design.md).

    {"prompt_id": "dsr-00017", "epoch": 3, "sample": 2, "prompt_len": 118,
     "response_len": 6021, "truncated": false}

Unknown fields are ignored. Every field has a stated range, checked before anything is sized by it
(the planner's arrays, the simulator's groups, the rollout's positions):

    prompt_id      a string (within the line's bound)
    epoch          0 .. MAX_EPOCH         (a rollout's index: far beyond any run's count)
    sample         0 .. MAX_SAMPLE        (the index in a GRPO group: far beyond any group's size)
    prompt_len     0 .. MAX_LENGTH        (tokens: beyond any model's positions)
    response_len   0 .. MAX_LENGTH
    truncated      true or false (default false)

and the file has bounds of its own: at most MAX_TRACE_BYTES in all (a regular file's size is checked
before a byte is read; a pipe or device is counted as it is read), MAX_LINE_BYTES a line, and no JSON
integer of more than MAX_INT_DIGITS digits. A malformed line, a missing field, a wrong type or a
value out of range is a `TraceError` naming the file and the 1-based line number. A predictor
evaluated on epoch `e` may read only epochs `< e`: use `Trace.before(e)` so the cut is explicit.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

from elastic.errors import InputError, shorten


class TraceError(InputError, ValueError):
    """A trace file that does not follow the format; the message names file and line."""


@dataclass(frozen=True)
class TraceRecord:
    prompt_id: str
    epoch: int
    sample: int
    prompt_len: int
    response_len: int
    truncated: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_id, self.sample)


_FIELDS = {
    "prompt_id": str,
    "epoch": int,
    "sample": int,
    "prompt_len": int,
    "response_len": int,
}


# No model has this many positions (Qwen3: 32k-128k); a longer length is a unit mix-up or a typo, and
# every consumer (planner, simulator, rollout) would size arrays by it.
MAX_LENGTH = 2**24
# The predictor sizes per-epoch arrays by the largest epoch (np.bincount: 8 MB here, 711 PiB at
# 1e17), and a run of a million rollouts is far past any real one.
MAX_EPOCH = 2**20 - 1
# The partial-rollout simulator holds `largest sample + 1` responses per group; real groups are
# 4-512 responses.
MAX_SAMPLE = 2**12 - 1
# Each integer field's largest value, and what a larger one would be beyond.
_RANGES = {"epoch": (MAX_EPOCH, "any run's rollouts"), "sample": (MAX_SAMPLE, "any GRPO group's size"),
           "prompt_len": (MAX_LENGTH, "any model's positions"), "response_len": (MAX_LENGTH, "any model's positions")}
# A trace line is about 110 bytes (4.3 GB hold 39M responses: 10,000 rollouts of 3,900); a file
# past this is not a trace (/dev/zero, a concatenation gone wrong). In memory a trace takes about
# 3.5x its file.
MAX_TRACE_BYTES = 2**32
# A JSON Lines row of any kind (a trace line, a dataset row with a long chat) stays well below this;
# without it one line of /dev/zero grows until memory runs out.
MAX_LINE_BYTES = 2**26
# Python's own default bound on converting an integer's digits (quadratic time beyond it), stated
# here because an interpreter may run with it lifted (PYTHONINTMAXSTRDIGITS=0).
MAX_INT_DIGITS = 4300
# A line that may hold such an integer (or only a long digit run in a string) is decoded with the
# bound; the others, nearly all, by the decoder's fast path.
_LONG_DIGITS = re.compile(r"\d{%d}" % (MAX_INT_DIGITS + 1))


def parse_record(obj: object, where: str) -> TraceRecord:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    values = {}
    for name, tp in _FIELDS.items():
        if name not in obj:
            raise TraceError(f"{where}: missing field {name!r}")
        v = obj[name]
        if tp is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise TraceError(f"{where}: field {name!r}: expected an integer, got {shorten(repr(v))}")
        if tp is str and not isinstance(v, str):
            raise TraceError(f"{where}: field {name!r}: expected a string, got {shorten(repr(v))}")
        values[name] = v
    for name, (most, beyond) in _RANGES.items():
        if values[name] < 0:
            raise TraceError(f"{where}: field {name!r}: expected >= 0, got {values[name]}")
        if values[name] > most:
            unit = " tokens" if most == MAX_LENGTH else ""
            raise TraceError(f"{where}: field {name!r} is {shorten(values[name], 40)}{unit}, beyond {beyond} "
                             f"(at most {most})")
    truncated = obj.get("truncated", False)
    if not isinstance(truncated, bool):
        raise TraceError(f"{where}: field 'truncated': expected true or false, got {shorten(repr(truncated))}")
    return TraceRecord(truncated=truncated, **values)


class Trace:
    """An in-memory trace: records plus the cap they were generated under (if known)."""

    def __init__(self, records: Iterable[TraceRecord], source: str = "<memory>"):
        self.records = list(records)
        self.source = source

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[TraceRecord]:
        return iter(self.records)

    @property
    def epochs(self) -> list[int]:
        return sorted({r.epoch for r in self.records})

    def epoch(self, e: int) -> list[TraceRecord]:
        """The batch of one rollout, in data order (prompt order of first appearance, then sample)."""
        batch = [r for r in self.records if r.epoch == e]
        if not batch:
            raise TraceError(f"{self.source}: no records for epoch {e} (epochs: {self.epochs})")
        return batch

    def before(self, e: int) -> "Trace":
        """The history a predictor for epoch `e` may read: epochs strictly before `e`."""
        return Trace((r for r in self.records if r.epoch < e), f"{self.source}[epoch<{e}]")


class _LongInteger(Exception):
    """A JSON integer of more digits than MAX_INT_DIGITS (raised from the decoder's int hook)."""


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _LongInteger(len(digits.lstrip("-")))
    return int(digits)


def _lines(fh, path: Path, error: type[Exception], what: str, max_bytes: int | None):
    """The raw lines of open file `fh`, each at most MAX_LINE_BYTES and all of them at most
    `max_bytes` (None: no bound on the whole): a regular file's size is checked before it is read,
    anything else (a pipe, a device) as it is read."""
    info = os.fstat(fh.fileno())
    if max_bytes is not None and stat.S_ISREG(info.st_mode) and info.st_size > max_bytes:
        raise error(f"{path}: {info.st_size} bytes, more than a {what} may hold (at most {max_bytes})")
    total = 0
    for lineno, raw in enumerate(iter(lambda: fh.readline(MAX_LINE_BYTES + 1), b""), start=1):
        total += len(raw)
        if len(raw) > MAX_LINE_BYTES:
            raise error(f"{path}:{lineno}: a line longer than {MAX_LINE_BYTES} bytes")
        if max_bytes is not None and total > max_bytes:
            raise error(f"{path}: more than {max_bytes} bytes, more than a {what} may hold")
        yield raw


def iter_jsonl(path: Path, error: type[Exception], what: str, max_bytes: int | None = None):
    """`(where, lineno, obj)` for each non-blank line of a JSON Lines file; `obj` is an `error`
    instance for a line that is not JSON (or not UTF-8), so a caller can raise it or count it and go on.
    The file's bounds (`max_bytes` in all, MAX_LINE_BYTES a line) are raised, never counted."""
    try:
        fh = path.open("rb")
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror})") from None
    with fh:
        offset = 0  # of the line's first byte in the file
        for lineno, raw in enumerate(_lines(fh, path, error, what, max_bytes), start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, lineno, error(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at file "
                                           f"offset {offset + e.start})")
                continue
            finally:
                offset += len(raw)
            if not line.strip():
                continue
            try:
                obj = json.loads(line, **({"parse_int": _bounded_int} if _LONG_DIGITS.search(line) else {}))
            except json.JSONDecodeError as e:
                obj = error(f"{where}: not valid JSON ({e.msg})")
            except _LongInteger as e:
                obj = error(f"{where}: an integer of {e.args[0]} digits (at most {MAX_INT_DIGITS})")
            except RecursionError:
                obj = error(f"{where}: JSON nested too deeply")
            yield where, lineno, obj


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    records = []
    seen: dict[tuple[int, str, int], int] = {}
    for where, lineno, obj in iter_jsonl(path, TraceError, "trace", MAX_TRACE_BYTES):
        if isinstance(obj, TraceError):
            raise obj
        rec = parse_record(obj, where)
        k = (rec.epoch, rec.prompt_id, rec.sample)
        if k in seen:
            raise TraceError(f"{where}: duplicate (epoch, prompt_id, sample) {k}, first on line {seen[k]}")
        seen[k] = lineno
        records.append(rec)
    if not records:
        raise TraceError(f"{path}: the trace is empty")
    return Trace(records, str(path))


def write_trace(records: Iterable[TraceRecord], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(asdict(r)) + "\n")
