"""The `partial` section of a checkpoint's trainer_state.json, checked on the driver before any rank
starts (a mismatch is one line here, not a failure inside every rank): a resume either continues
the carried groups with a config they fit, or drops them only when told to (`partial.drop_carried`),
counted in the log.

The section is `PartialRollouts.state_dict()` (rl/rollout_phase/partial.py): `queue`, the [data index, epoch] of
prompts drawn but not launched, and `pool`, `CarryPool.state_dict()` (elastic/planning/partial.py):
`next_uid`, `trained` and the `pending` groups, each with its G samples (tokens so far, their
behaviour log-probs, the policy versions that sampled them). Everything the ranks would index,
encode or train on is checked here, so a bad file is one line naming file and field, not an engine
error after a full rollout.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from elastic.planning.partial import CarryPool
from megatron_rl.errors import CheckpointError
from megatron_rl.rl.checkpoint.route_state import load_routes


def check_partial_resume(cfg, data, tok, path: Path, state: dict) -> None:
    """Before the ranks load checkpoint `path`: its partial section fits `cfg` and `data`, or is
    refused (partial off: unless `partial.drop_carried`, then what is dropped is logged)."""
    if "partial" not in state:
        return
    f = path / "trainer_state.json"
    section = _Section(f, cfg, data, tok, state["step"])
    groups, queued = section.check(state["partial"])
    _check_routes(cfg, state["partial"], f)
    if cfg.partial.enabled or not (groups or queued):
        return
    what = f"{groups} carried groups and {queued} drawn prompts not yet launched"
    if not cfg.partial.drop_carried:
        raise CheckpointError(f"{f}: partial: {what} from a partial run; resume with partial.enabled=true "
                              "to continue them, or partial.drop_carried=true to drop them")
    print(f"[train] {f}: dropping {what} (partial.drop_carried=true)", file=sys.stderr, flush=True)


def _check_routes(cfg, section: dict, f: Path) -> None:
    """The carried routes (`partial.routes`), by the check the ranks' load makes (rl/checkpoint/route_state.py)."""
    pool = CarryPool(cfg.partial.rule(), cfg.grpo.group_size, cfg.prompts_per_step)
    pool.load_state_dict(section["pool"])
    load_routes(section.get("routes", []), pool, cfg.model, f)


class _Section:
    """One walk over the section; each error names the file and the field's path in it."""

    def __init__(self, f: Path, cfg, data, tok, step: int):
        self.f, self.cfg, self.data, self.tok, self.step = f, cfg, data, tok, step

    def fail(self, where: str, what: str):
        raise CheckpointError(f"{self.f}: partial.{where}: {what}")

    def of(self, value, tp, where: str):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            self.fail(where, f"expected {tp.__name__ if isinstance(tp, type) else 'a number'}, got "
                      f"{type(value).__name__}")
        return value

    def int_in(self, value, lo: int, hi: int | None, where: str) -> int:
        self.of(value, int, where)
        if value < lo or (hi is not None and value >= hi):
            self.fail(where, f"expected an integer in [{lo}, {hi if hi is not None else 'inf'}), got {value}")
        return value

    def check(self, section) -> tuple[int, int]:
        """(pending groups, queued prompts) of a valid section."""
        n = len(self.data)
        self.of(section, dict, "")
        queue = self.of(section.get("queue"), list, "queue")
        for i, q in enumerate(queue):
            if not (isinstance(q, list) and len(q) == 2):
                self.fail(f"queue[{i}]", "expected [data index, epoch]")
            self.int_in(q[0], 0, n, f"queue[{i}][0] (data index; the dataset has {n} prompts)")
            self.int_in(q[1], 0, None, f"queue[{i}][1] (epoch)")
        pool = self.of(section.get("pool"), dict, "pool")
        next_uid = self.int_in(pool.get("next_uid"), 0, None, "pool.next_uid")
        pending = self.of(pool.get("pending"), list, "pool.pending")
        trained = self.int_in(pool.get("trained"), 0, None, "pool.trained")
        seen: set[int] = set()
        for i, g in enumerate(pending):
            uid = self.group(g, f"pool.pending[{i}]", next_uid)
            if uid in seen:
                self.fail(f"pool.pending[{i}].uid", f"group {uid} is listed twice")
            seen.add(uid)
        if trained + len(pending) != next_uid:
            self.fail("pool", f"expected trained + pending groups = the {next_uid} launched, got {trained} trained "
                      f"+ {len(pending)} pending")
        return len(pending), len(queue)

    def group(self, g, where: str, next_uid: int) -> int:
        self.of(g, dict, where)
        uid = self.int_in(g.get("uid"), 0, next_uid, f"{where}.uid")
        payload = self.of(g.get("payload"), dict, f"{where}.payload")
        n = len(self.data)
        index = self.int_in(payload.get("index"), 0, n, f"{where}.payload.index (the dataset has {n} prompts)")
        self.int_in(payload.get("epoch"), 0, None, f"{where}.payload.epoch")
        prompt = self.data[index]
        if g.get("prompt_id") != prompt.prompt_id:
            self.fail(f"{where}.prompt_id", f"expected {prompt.prompt_id!r} (row {index} of {self.cfg.data.path}), "
                      f"got {g.get('prompt_id')!r} (the dataset changed since the checkpoint)")
        samples = self.of(g.get("samples"), list, f"{where}.samples")
        G = self.cfg.grpo.group_size
        if len(samples) != G:
            self.fail(f"{where}.samples", f"expected a group of grpo.group_size {G} samples, got {len(samples)}; "
                      f"resume with grpo.group_size={len(samples)}")
        prompt_len = len(self.tok.encode_prompt(prompt))
        for j, s in enumerate(samples):
            self.sample(s, f"{where}.samples[{j}]", g["prompt_id"], uid * G + j, j, prompt_len)
        return uid

    def sample(self, s, where: str, prompt_id: str, rid: int, j: int, prompt_len: int) -> None:
        self.of(s, dict, where)
        for key, want in (("prompt_id", prompt_id), ("sample", j), ("rid", rid), ("prompt_len", prompt_len)):
            if s.get(key) != want or isinstance(s.get(key), bool):
                self.fail(f"{where}.{key}", f"expected {want!r} (its group's), got {s.get(key)!r}")
        done = self.of(s.get("done"), bool, f"{where}.done")
        cap = self.cfg.generation.max_response_len
        n = self.int_in(s.get("n"), 0, cap + done, f"{where}.n (generation.max_response_len is {cap})")
        tokens = self.of(s.get("tokens"), list, f"{where}.tokens")
        logprobs = self.of(s.get("logprobs"), list, f"{where}.logprobs")
        if len(tokens) != n or len(logprobs) != n:
            self.fail(where, f"expected n {n} tokens and log-probs, got {len(tokens)} and {len(logprobs)}")
        vocab = self.cfg.model.vocab_size
        for k, t in enumerate(tokens):
            self.int_in(t, 0, vocab, f"{where}.tokens[{k}] (model.vocab_size is {vocab})")
        for k, lp in enumerate(logprobs):
            if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not (math.isfinite(lp) and lp <= 0):
                self.fail(f"{where}.logprobs[{k}]", f"expected a finite log-probability <= 0, got {lp!r}")
        segments = self.of(s.get("segments"), list, f"{where}.segments")
        total = 0
        for k, seg in enumerate(segments):
            if not (isinstance(seg, list) and len(seg) == 2):
                self.fail(f"{where}.segments[{k}]", "expected [policy version, tokens]")
            self.int_in(seg[0], 1, self.step + 1, f"{where}.segments[{k}][0] (policy version; checkpoint step "
                                                  f"{self.step})")
            total += self.int_in(seg[1], 1, None, f"{where}.segments[{k}][1]")
        if total != n:
            self.fail(f"{where}.segments", f"expected n {n} tokens, got {total}")
