"""The chat template is an input: the driver renders the first rows under a time and memory bound.

A tokenizer's chat template is jinja the user brings with the tokenizer files. transformers renders
it in jinja's sandbox, which keeps it from reading files or running code, but not from looping for
hours (`range` nested in `range`) or building a string of gigabytes (`'x' * 10**9`). So before any
rank starts, `check_chat_template` renders the first `FIRST_ROWS` prompts of a file in a fork of
the driver (which holds the loaded tokenizer; it starts no rank and holds no device), whose address
space is capped `RENDER_BYTES` above the driver's, each render within `RENDER_S`. A render that
raises (a syntax error, `raise_exception`, an undefined name, the sandbox's refusal), renders
nothing, is longer than the model's positions could hold (`CHARS_PER_POSITION`), or runs out of
time or memory is one line naming the row, the template's file and the cause. Every later row is
encoded on the driver too (`rl/input_checks.py`), without these bounds; an error of theirs is still
one line (`HFTokenizer`).
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import time
from pathlib import Path

from megatron_rl.data.prompts import Prompt
from megatron_rl.data.tokenizer import HFTokenizer, Tokenizer
from megatron_rl.errors import FlexFloorError
from megatron_rl.user_code import frames

FIRST_ROWS = 8
RENDER_S = 10.0  # one row's render and tokenization (a real template takes milliseconds)
RENDER_BYTES = 2 << 30  # address space the renders may add to the driver's
# Characters a position may hold in a render: no tokenizer's tokens are this long on average, so a
# longer render cannot fit model.max_position_embeddings, and is refused before it is tokenized.
CHARS_PER_POSITION = 64


def check_chat_template(tok: Tokenizer, prompts: list[Prompt], positions: int) -> None:
    """Render the first rows of `prompts` through `tok`'s chat template (an HF tokenizer with
    `chat_template: true`; nothing to do otherwise), bounded; `FlexFloorError` naming the row."""
    if not isinstance(tok, HFTokenizer) or not tok.chat_template or not prompts:
        return
    rows = prompts[:FIRST_ROWS]
    answers, child_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: it only renders, answers and leaves, with no exit handler of the driver's
        os.close(answers)
        try:
            _render_rows(tok, rows, CHARS_PER_POSITION * positions, child_end)
        finally:
            os._exit(0)
    os.close(child_end)
    try:
        for p in rows:
            _answer(answers, pid, f"{p.where}: {tok.template_file}: chat template", p.where)
    finally:
        os.close(answers)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):  # reaped already by _status
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _answer(answers: int, pid: int, where: str, row: str) -> None:
    try:
        answer = json.loads(frames.receive(answers, time.monotonic() + RENDER_S))
    except frames.Late:
        raise FlexFloorError(f"{where}: rendering did not finish within {RENDER_S:g} s") from None
    except frames.Closed:
        raise FlexFloorError(f"{where}: rendering ended its process ({_status(pid)}; the renders may use "
                             f"{RENDER_BYTES >> 30} GiB)") from None
    if "error" in answer:
        raise FlexFloorError(f"{row}: {answer['error']}")


def _status(pid: int) -> str:
    status = os.waitpid(pid, 0)[1]
    return f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit status {os.WEXITSTATUS(status)}"


def _render_rows(tok: HFTokenizer, rows: list[Prompt], max_chars: int, out: int) -> None:
    """(In the fork.) Cap the address space, then render each row: one answer frame each ({} or
    {"error": one line})."""
    size = os.sysconf("SC_PAGE_SIZE") * int(Path("/proc/self/statm").read_text().split()[0])
    resource.setrlimit(resource.RLIMIT_AS, (size + RENDER_BYTES, resource.getrlimit(resource.RLIMIT_AS)[1]))
    for p in rows:
        frames.send(out, json.dumps(_render(tok, p, max_chars)).encode())


def _render(tok: HFTokenizer, prompt: Prompt, max_chars: int) -> dict:
    try:
        text = tok.render_prompt(prompt)
        if len(text) > max_chars:
            return {"error": f"{tok.template_file}: chat template: rendered {len(text)} characters, more than "
                             f"{CHARS_PER_POSITION} a position for model.max_position_embeddings could hold "
                             f"({max_chars})"}
        tok.encode_prompt(prompt)
    except FlexFloorError as e:
        bound = f" (past the {RENDER_BYTES >> 30} GiB a render may use)" if "MemoryError" in str(e) else ""
        return {"error": str(e) + bound}
    except MemoryError:  # in the tokenizer, after the render
        return {"error": f"{tok.template_file}: chat template: its render needs more than the "
                         f"{RENDER_BYTES >> 30} GiB a render may use"}
    return {}
