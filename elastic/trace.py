"""Length traces: JSON Lines, one response per line (format in docs/design.md).

    {"prompt_id": "dsr-00017", "epoch": 3, "sample": 2, "prompt_len": 118,
     "response_len": 6021, "truncated": false}

Unknown fields are ignored. A malformed line, a missing field, a wrong type or a negative length is
a `TraceError` naming the file and the 1-based line number. A predictor evaluated on epoch `e` may
read only epochs `< e`: use `Trace.before(e)` so the cut is explicit.
"""
from __future__ import annotations

import json
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
    for name in ("epoch", "sample", "prompt_len", "response_len"):
        if values[name] < 0:
            raise TraceError(f"{where}: field {name!r}: expected >= 0, got {values[name]}")
    for name in ("prompt_len", "response_len"):
        if values[name] > MAX_LENGTH:
            raise TraceError(f"{where}: field {name!r} is {shorten(values[name], 40)} tokens, beyond any "
                             f"model's positions (at most {MAX_LENGTH})")
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


def iter_jsonl(path: Path, error: type[Exception], what: str):
    """`(where, lineno, obj)` for each non-blank line of a JSON Lines file; `obj` is an `error`
    instance for a line that is not JSON (or not UTF-8), so a caller can raise it or count it and go on."""
    try:
        fh = path.open("rb")
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror})") from None
    with fh:
        offset = 0  # of the line's first byte in the file
        for lineno, raw in enumerate(fh, start=1):
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
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                obj = error(f"{where}: not valid JSON ({e.msg})")
            except RecursionError:
                obj = error(f"{where}: JSON nested too deeply")
            yield where, lineno, obj


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    records = []
    seen: dict[tuple[int, str, int], int] = {}
    for where, lineno, obj in iter_jsonl(path, TraceError, "trace"):
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
