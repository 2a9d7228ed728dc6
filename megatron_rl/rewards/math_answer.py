"""Math answer verification: `math-verify` first, a guarded sympy comparison as the fallback.

`math-verify` extracts the final answer from free text (a \\boxed{} or the last expression), parses
LaTeX and plain expressions to sympy and compares them numerically and symbolically. Where it finds
nothing to compare (an answer in a form its extractors miss), the fallback takes the last \\boxed{}
or the last number-like span of the response and compares it with the reference in sympy.

The fallback only ever parses short arithmetic over digits, `.`, `+ - * /` and parentheses:
`parse_expr` evaluates Python, and a model's output must never reach it unfiltered (no names, no
powers that could take minutes).

`math-verify` is imported at the first verification, not with this module: the `exact` reward, and
every engine path that imports the rewards' configs, run where it is not installed (the bare GPU
image carries it as a wheel, docs/gpu.md).

`math-verify` bounds each parse and comparison with `signal.alarm`, which works only in a process's
main thread; off the main thread (a scoring lease running beside the rollout) the bound is dropped.
"""
from __future__ import annotations

import logging
import re
import threading
from functools import lru_cache

import sympy
from sympy.parsing.sympy_parser import parse_expr

CORRECT, WRONG, UNPARSABLE, NO_REFERENCE = "correct", "wrong", "unparsable", "no_reference"


def _not_timeout_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Timeout is disabled")


# Off the main thread the bound is dropped on purpose (above); math-verify would warn about it at
# every call, flooding the log of every scoring lease.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_not_timeout_notice)

_SAFE = re.compile(r"^[0-9.+\-*/() ]{1,64}$")
_NUMBERISH = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?")


@lru_cache(maxsize=1)
def _math_verify():
    """math-verify's (parse, verify, prediction extraction, reference extraction)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    return (parse, verify, (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()),
            (LatexExtractionConfig(), ExprExtractionConfig()))


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def candidate_answer(text: str) -> str | None:
    """What the fallback compares: the last \\boxed{} content, else the last number-like span."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    spans = _NUMBERISH.findall(text)
    return spans[-1].replace(",", "") if spans else None


def _sympy_value(s: str | None):
    if s is None:
        return None
    s = s.strip().replace("\\frac{", "(").replace("}{", ")/(").replace("}", ")")
    if not _SAFE.match(s) or "**" in s:
        return None
    try:
        return sympy.nsimplify(parse_expr(s))
    except Exception:  # sympy's parser raises SyntaxError, TokenError, TypeError, ...  # noqa: BLE001
        return None


@lru_cache(maxsize=65536)
def _parse_gold(gold: str, timeout: int | None):
    parse, _verify, _pred_config, gold_config = _math_verify()
    text = gold if "$" in gold or "\\boxed" in gold else f"${gold}$"
    return parse(text, extraction_config=gold_config, parsing_timeout=timeout)


def verify_math(response: str, reference: str | None, timeout_s: int = 5) -> str:
    """Outcome of comparing `response` with `reference`: correct, wrong, unparsable or no_reference."""
    if reference is None or not str(reference).strip():
        return NO_REFERENCE
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    parse, verify, pred_config, _gold_config = _math_verify()
    gold = _parse_gold(str(reference), timeout)
    pred = parse(response, extraction_config=pred_config, parsing_timeout=timeout)
    if gold and pred:
        return CORRECT if verify(gold, pred, timeout_seconds=timeout) else WRONG
    want, got = _sympy_value(str(reference)), _sympy_value(candidate_answer(response))
    if want is None:
        return NO_REFERENCE
    if got is None:
        return UNPARSABLE
    return CORRECT if sympy.simplify(want - got) == 0 else WRONG
