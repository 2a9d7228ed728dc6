"""JSON from files someone else may have written, read with bounded depth.

Python's decoder recurses once per nesting level: 100,000 `[` raise a RecursionError (a traceback
where a line was promised), and deep values break whatever walks them later. Nothing FlexFloor
reads nests deeper than a few levels, so the depth is checked before the text is parsed.
"""
from __future__ import annotations

import json
import re

import numpy as np

MAX_DEPTH = 64
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def depth(data: bytes) -> int:
    """How deeply the brackets of JSON text `data` nest (outside strings)."""
    arr = np.frombuffer(_STRING.sub(b"", data), dtype=np.uint8)
    step = np.isin(arr, (ord("["), ord("{"))).astype(np.int64) - np.isin(arr, (ord("]"), ord("}")))
    return int(np.cumsum(step).max(initial=0))


def loads(data: bytes | str, max_depth: int = MAX_DEPTH):
    """`json.loads`, refusing text nested deeper than `max_depth` with a ValueError (as a JSON
    syntax error is one), so callers name the file in one line for either."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if depth(raw) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    return json.loads(raw)
