"""`flexfloor train`: bad configs, data, flags, output folders and run-folder files (what a resume
reads) are one line naming the file, field or flag, exit 2, before any rank starts."""
import errno
import json
import sys

import pytest
import torch
import yaml

from megatron_rl.cli import main
from megatron_rl.errors import FlexFloorError
from megatron_rl.parallel.disk_full import DiskFull
from megatron_rl.rl.checkpoint.dcp import CheckpointError, latest_checkpoint, read_state_json
from tests.helpers.cli import listing as _listing
from tests.process_tree import live_children
from tests.process_tree import one_line_exit_2 as _one_line_exit_2

TINY_TRAIN = {
    "model": {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "num_query_groups": 1,
              "kv_channels": 8, "num_moe_experts": 4, "moe_router_topk": 1, "moe_ffn_hidden_size": 8,
              "vocab_size": 20, "max_position_embeddings": 16},
    "tokenizer": {"kind": "char", "alphabet": "0123456789+-*=() "},
    "grpo": {"group_size": 2}, "generation": {"max_response_len": 4}, "prompts_per_step": 2, "ranks": 2,
}


def test_bad_input_is_one_line_exit_2_before_any_rank(files, refuses_each):
    w, latin1_yaml, a_file, loop, long, too_long, out, tmp = (
        files.w, files.latin1_yaml, files.a_file, files.loop, files.long, files.too_long, files.out, files.tmp)

    def train_cfg(name, rows, **changes):
        data = w(f"{name}.jsonl", rows)
        return w(f"{name}.yaml", yaml.safe_dump({**TINY_TRAIN, "data": {"path": data}, **changes}))

    rows = "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4))
    bad_char = '{"prompt": "1+x=", "answer": "1"}\n'

    def heldout_cfg(name, row, first=None):
        first = rows.splitlines(True)[0] if first is None else first
        return train_cfg(name, rows, eval={"every": 1, "path": w(f"{name}_heldout.jsonl", first + row + "\n")})

    refuses_each("train", [
        (["--config", latin1_yaml], [f"{latin1_yaml}:2: not UTF-8 text"]),
        (["--config", train_cfg("latin1_data", rows.encode() + '{"prompt": "caf\xe9"}\n'.encode("latin-1"))],
         ["latin1_data.jsonl:5: not UTF-8 text (byte 0xe9 at file offset"]),
        (["--config", train_cfg("small", rows, prompts_per_step=8)],
         ["small.jsonl: 4 usable prompts, fewer than one step's prompts_per_step (8)"]),
        (["--config", train_cfg("alphabet", rows + '{"prompt": "1+x=", "answer": "1"}\n')],
         ["alphabet.jsonl:5: character 'x'"]),
        (["--config", train_cfg("noprompt", rows + '{"question": "2+2=", "answer": "4"}\n')],
         ["noprompt.jsonl:5: missing prompt field 'prompt'"]),
        (["--config", train_cfg("long", rows + json.dumps({"prompt": "1+" * 8 + "1=", "answer": "9"}) + "\n")],
         ["long.jsonl:5: prompt of 19 tokens", "exceeds model.max_position_embeddings (16)"]),
        # held-out prompts (eval.path) go through the training data's checks
        (["--config", heldout_cfg("ho_long", json.dumps({"prompt": "1+" * 8 + "1=", "answer": "9"}))],
         ["ho_long_heldout.jsonl:2: prompt of 19 tokens", "exceeds model.max_position_embeddings (16)"]),
        (["--config", heldout_cfg("ho_char", '{"prompt": "1+x=", "answer": "1"}')],
         ["ho_char_heldout.jsonl:2: character 'x'"]),
        (["--config", heldout_cfg("ho_noans", '{"prompt": "1+1="}', first="")],
         ["ho_noans_heldout.jsonl: no row has a reference answer"]),
        # ... and so do the warm start's own prompts (warmstart.path)
        (["--config", train_cfg("ws", rows, warmstart={"sft_steps": 1, "path": w("wsx.jsonl", rows + bad_char)})],
         ["wsx.jsonl:5: character 'x'"]),
        (["--config", train_cfg("ws1", rows, warmstart={"sft_steps": 1, "path": w("ws1_sft.jsonl", rows[:33])})],
         ["ws1_sft.jsonl: 1 prompts with an answer to learn from, fewer than the 2 ranks"]),
        (["--config", train_cfg("ok", rows), "--out", a_file], [f"--out {a_file}: exists and is not a folder"]),
        (["--config", train_cfg("ok2", rows), "--out", out, "--json", str(tmp / "nope" / "s.json")],
         [f"--json {tmp / 'nope' / 's.json'}: folder {tmp / 'nope'} does not exist"]),
        (["--config", train_cfg("ok3", rows), "--out", str(loop)], [f"--out {loop}: a symlink loop"]),
        (["--config", train_cfg("ok4", rows), "--out", out, "--json", str(loop)],
         [f"--json {loop}: a symlink loop"]),
        (["--config", train_cfg("ok5", rows), "--out", long], [too_long]),
        (["--config", train_cfg("meg", rows, backend="megatron"), "--policy", "adaptive"],
         ["--policy adaptive: elastic.policy adaptive: its ladder of stages needs arbitrary expert ownership"]),
    ])


# (override, what the one line names): see `refuses_value`.
BAD_VALUES = [
    ("generation.max_batch_per_rank=0", "generation.max_batch_per_rank: expected > 0"),
    ("timeout_s=.inf", "expected a finite number"),
    ("timeout_s=1e300", "timeout_s: expected seconds in [1,"),
    ("timeout_s=0.01", "timeout_s: expected seconds in [1,"),
    ("seed=-1", "seed: expected an integer in [0, 2^32)"),
    ("seed=100000000000000000000000", "expected an integer of at most 2^63 - 1"),
    ("optim.lr=.nan", "expected a finite number"),
    ("checkpoint.stop_grace_s=1e300", "checkpoint.stop_grace_s: expected seconds"),
    ("leases.lease_s=1e9", "leases.lease_s: expected seconds"),
    ("data.template='{prompt} {x}'", "only {prompt} may be filled in, got {x}"),
    ("data.template='{prompt} {'", "Single '{'"),
    ("data.template='{0}{prompt}'", "got {0}"),
    ("generation.max_response_len=4096", "expected below model.max_position_embeddings"),
    ("grpo.group_size=1000000", "grpo.group_size 1000000 = 4e+06 responses per rollout, above the "
                                 "limit of 2^20"),
    ("partial.over_sample=-1", "partial.over_sample: expected a number >= 0"),  # also when off
    ("partial.token_budget=-1", "partial.token_budget: only read with end 'budget'"),
    ("model.vocab_size=1000000000000", "vocab_size: expected an integer in [1, 2^24]"),
    ("generation.kv_page_size=16777216", "generation.kv_page_size: expected at most model.max_position_embeddings"),
]


@pytest.mark.parametrize("override,expect", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_a_value_that_would_hang_or_crash_is_one_line(cfg, tmp_path, refuses_value, override, expect):
    refuses_value(["train", "--config", cfg, "--out", tmp_path / "out"], override, expect)


def test_offload_without_a_working_deepspeed_is_one_line_before_any_rank(tmp_path, capsys, monkeypatch):
    """`optim.offload: cpu` with DeepSpeed missing, or its CPU Adam failing to
    JIT-build, is one line on the driver; a failed build shows the compiler's last error lines."""
    import types

    rows = "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4))
    (tmp_path / "d.jsonl").write_text(rows)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**TINY_TRAIN, "data": {"path": str(tmp_path / "d.jsonl")}, "dtype": "float32",
                                   "optim": {"offload": "cpu"}}))
    argv = ["train", "--config", str(cfg), "--out", str(tmp_path / "out")]

    def one_line(*fragments):
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and all(f in lines[0] for f in fragments), lines
        assert not live_children()

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    one_line("optim.offload: cpu needs deepspeed (pip install deepspeed); importing it failed: ")

    class Builder:
        def load(self, verbose=False):
            raise RuntimeError("Error building extension 'cpu_adam': [1/3] c++ -c cpu_adam.cpp -O3\n"
                               "FAILED: cpu_adam.o\ncpu_adam.cpp:12:5: error: 'simd_load' was not declared\n"
                               "cpu_adam.cpp:40:1: error: expected ';' before '}' token\n"
                               "ninja: build stopped: subcommand failed.\n")

    for name in ("deepspeed", "deepspeed.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "deepspeed.ops.op_builder", types.SimpleNamespace(CPUAdamBuilder=Builder))
    one_line("optim.offload: cpu: DeepSpeed's CPU Adam did not build (RuntimeError: cpu_adam.cpp:12:5: error: "
             "'simd_load' was not declared | cpu_adam.cpp:40:1: error: expected ';' before '}' token)")


def test_sft_warmstart_replaces_only_its_own_export(tmp_path, capsys):
    """`tools/sft_warmstart.py --out` exports under `export --to`'s rule: a non-empty
    folder that is not a FlexFloor export (a base model, `.`) is refused before any rank starts,
    and left as it was (it was replaced whole)."""
    import runpy

    rows = "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4))
    (tmp_path / "d.jsonl").write_text(rows)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**TINY_TRAIN, "data": {"path": str(tmp_path / "d.jsonl")},
                                   "warmstart": {"sft_steps": 1}}))
    theirs = tmp_path / "base_model"
    theirs.mkdir()
    (theirs / "config.json").write_text("{}")
    sys.argv = ["sft_warmstart.py", "--config", str(cfg), "--out", str(theirs)]
    with pytest.raises(SystemExit) as stop:
        runpy.run_path("tools/sft_warmstart.py", run_name="__main__")
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"sft_warmstart: error: --out {theirs}: "
                             "is a non-empty folder that is not a FlexFloor export")
    assert sorted(p.name for p in theirs.iterdir()) == ["config.json"] and not live_children()


@pytest.mark.parametrize("content", [b"\xff\xfe", b"[1, 2]", b'{"step": "3", "model": {}, "data": {}}',
                                     b"[" * 100_000, b'{"step": 1}'])
def test_a_corrupt_trainer_state_is_one_line(tmp_path, content):
    (tmp_path / "trainer_state.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'trainer_state.json'}: ") as e:
        read_state_json(tmp_path)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


@pytest.mark.parametrize("content", [b"\xff\x00\x01", b"../../etc", b"step_1 rm -rf"])
def test_a_latest_pointer_that_names_no_step_is_one_line(tmp_path, content):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_bytes(content)
    with pytest.raises(CheckpointError, match="latest: ") as e:
        latest_checkpoint(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("content", [b"\xff", b"[]", b'{"id": 3}', b"{" * 50_000])
def test_a_bad_wandb_run_json_is_one_line(tmp_path, content):
    from megatron_rl.metrics.logger import read_run_state

    (tmp_path / "wandb_run.json").write_bytes(content)
    with pytest.raises(FlexFloorError, match="wandb_run.json: unreadable"):
        read_run_state(tmp_path / "wandb_run.json")
    (tmp_path / "wandb_run.json").write_text(json.dumps({"id": "ab12", "last_step": 3}))
    assert read_run_state(tmp_path / "wandb_run.json") == {"id": "ab12", "last_step": 3}


# ---- the `partial` section of trainer_state.json ---------------
def _partial_resume(tmp_path, section: dict, step: int = 1, **changes):
    """check_partial_resume of `section` against the tiny example with partial on, group_size 2."""
    from megatron_rl.config import load_dataclass
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.data.tokenizer import build_tokenizer
    from megatron_rl.rl.checkpoint.partial_state import check_partial_resume
    from megatron_rl.trainer_config import TrainerConfig

    overrides = {"partial.enabled": True, "grpo.group_size": 2, **changes}
    cfg = load_dataclass(TrainerConfig, "examples/tiny_cpu_grpo.yaml", overrides)
    data = load_prompts(cfg.data)
    check_partial_resume(cfg, data, build_tokenizer(cfg.tokenizer), tmp_path, {"step": step, "partial": section})


def _section() -> dict:
    """What PartialRollouts.state_dict() writes: one pending group (row 3, uid 1) of 2 samples, one
    complete, one carried, and one drawn prompt not yet launched."""
    samples = [{"prompt_id": "arith-00003", "sample": j, "prompt_len": 5, "rid": 2 + j, "n": 2, "done": j == 0,
                "segments": [[1, 2]], "tokens": [5, 6], "logprobs": [-1.0, -2.5]} for j in range(2)]
    return {"queue": [[7, 0]], "pool": {"next_uid": 2, "trained": 1, "pending": [
        {"uid": 1, "prompt_id": "arith-00003", "payload": {"index": 3, "epoch": 0}, "samples": samples}]}}


def _set(section: dict, path: str, value):
    node, *keys = section, *path.split("/")
    for k in keys[:-1]:
        node = node[int(k) if k.isdigit() else k]
    last = keys[-1]
    if value is KeyError:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return section


G0 = "pool/pending/0"
S1 = f"{G0}/samples/1"


@pytest.mark.parametrize("path, value, expect", [
    ("queue", "abc", "partial.queue: expected list, got str"),
    ("pool", KeyError, "partial.pool: expected dict, got NoneType"),
    ("queue/0/0", 10**6, "partial.queue[0][0] (data index; the dataset has 400 prompts): "
                         "expected an integer in [0, 400), got 1000000"),
    (f"{G0}/payload/index", 10**6, "partial.pool.pending[0].payload.index (the dataset has 400 prompts)"),
    (f"{G0}/payload/epoch", -1, "partial.pool.pending[0].payload.epoch: expected an integer in [0, inf), got -1"),
    (f"{S1}/logprobs/1", "x", "partial.pool.pending[0].samples[1].logprobs[1]: expected a finite log-probability"),
    (f"{S1}/logprobs/0", float("nan"), "samples[1].logprobs[0]: expected a finite log-probability <= 0, got nan"),
    (f"{S1}/logprobs/0", 0.5, "samples[1].logprobs[0]: expected a finite log-probability <= 0, got 0.5"),
    (f"{S1}/tokens/1", 20, "samples[1].tokens[1] (model.vocab_size is 20): expected an integer in [0, 20), got 20"),
    (f"{S1}/tokens/0", True, "samples[1].tokens[0] (model.vocab_size is 20): expected int, got bool"),
    (f"{S1}/tokens", [5], "samples[1]: expected n 2 tokens and log-probs, got 1 and 2"),
    (f"{S1}/segments", [[2, 2]], "samples[1].segments[0][0] (policy version; checkpoint step 1): "
                                 "expected an integer in [1, 2), got 2"),
    (f"{S1}/segments", [[1, 1]], "samples[1].segments: expected n 2 tokens, got 1"),
    (f"{S1}/rid", 7, "samples[1].rid: expected 3 (its group's), got 7"),
    (f"{S1}/done", "no", "samples[1].done: expected bool, got str"),
    (f"{G0}/uid", 2, "partial.pool.pending[0].uid: expected an integer in [0, 2), got 2"),
    (f"{G0}/prompt_id", "arith-00004", "prompt_id: expected 'arith-00003' (row 3 of examples/data/arith_train.jsonl), "
                                      "got 'arith-00004' (the dataset changed since the checkpoint)"),
    (f"{G0}/samples", [], "samples: expected a group of grpo.group_size 2 samples, got 0"),
    ("pool/trained", 3, "partial.pool: expected trained + pending groups = the 2 launched, got 3 trained + 1 pending"),
])
def test_a_bad_partial_section_is_one_line_naming_file_and_field(tmp_path, path, value, expect):
    with pytest.raises(CheckpointError) as e:
        _partial_resume(tmp_path, _set(_section(), path, value))
    assert str(e.value).startswith(f"{tmp_path / 'trainer_state.json'}: partial") and expect in str(e.value)
    assert "\n" not in str(e.value)


def test_a_partial_section_that_does_not_fit_the_config_is_refused_before_the_ranks(tmp_path, capsys):
    _partial_resume(tmp_path, _section())  # the well-formed section passes
    twice = _section()
    twice["pool"]["pending"].append(twice["pool"]["pending"][0])
    with pytest.raises(CheckpointError, match=r"pending\[1\].uid: group 1 is listed twice"):
        _partial_resume(tmp_path, twice)
    with pytest.raises(CheckpointError, match=r"expected a group of grpo.group_size 4 samples, got 2; resume with "
                                              r"grpo.group_size=2"):
        _partial_resume(tmp_path, _section(), **{"grpo.group_size": 4})
    # the carried sample has 2 tokens: with max_response_len 2 it could generate none
    with pytest.raises(CheckpointError, match=r"samples\[1\].n \(generation.max_response_len is 2\): "
                                              r"expected an integer in \[0, 2\), got 2"):
        _partial_resume(tmp_path, _section(), **{"generation.max_response_len": 2})
    _partial_resume(tmp_path, _section(), **{"generation.max_response_len": 3})
    # partial off: the carried work is refused, or dropped and counted when asked
    with pytest.raises(CheckpointError, match=r"partial: 1 carried groups and 1 drawn prompts not yet launched "
                                              r"from a partial run; resume with partial.enabled=true"):
        _partial_resume(tmp_path, _section(), **{"partial.enabled": False})
    _partial_resume(tmp_path, _section(), **{"partial.enabled": False, "partial.drop_carried": True})
    assert "dropping 1 carried groups and 1 drawn prompts not yet launched (partial.drop_carried=true)" in \
        capsys.readouterr().err
    empty = {"queue": [], "pool": {"next_uid": 2, "trained": 2, "pending": []}}
    _partial_resume(tmp_path, empty, **{"partial.enabled": False})  # nothing carried: nothing to refuse


def test_carried_routes_are_checked_on_the_driver_too(tmp_path):
    """The carried routes (routing replay) are refused before any rank starts, as the rest of the section."""
    from megatron_rl.models.routes import encode

    # prompt 5 + 2 tokens - 1 positions, L 2, top-2 (experts 0 and 1)
    ok = torch.tensor([0, 1], dtype=torch.uint8).expand(5 + 2 - 1, 2, 2).clone()
    _partial_resume(tmp_path, {**_section(), "routes": [["arith-00003", 3, encode(ok)]]})
    bad = ok.clone()
    bad[0, 0, 0] = 8  # the tiny model has 8 experts
    with pytest.raises(CheckpointError, match=r"trainer_state.json: field partial.routes\[0\]: expert id 8 outside"):
        _partial_resume(tmp_path, {**_section(), "routes": [["arith-00003", 3, encode(bad)]]})
    bad = ok.clone()
    bad[3, 1] = 6  # top-2 ids [6, 6]: accepted and replayed as one expert weighted twice
    with pytest.raises(CheckpointError, match=r"partial.routes\[0\]: position 3, layer 1: top-k expert ids \[6, 6\] "
                                              r"repeat"):
        _partial_resume(tmp_path, {**_section(), "routes": [["arith-00003", 3, encode(bad)]]})
    with pytest.raises(CheckpointError, match=r"partial.routes\[0\]: response \('arith-00009', 0\) is not pending"):
        _partial_resume(tmp_path, {**_section(), "routes": [["arith-00009", 0, encode(ok)]]})


@pytest.mark.parametrize("saved, dtype", [(torch.float64, "bfloat16"), (torch.bfloat16, "float32")])
def test_a_dtype_change_on_resume_is_refused_before_the_ranks(tmp_path, saved, dtype):
    """Refused on the driver naming both dtypes (was an internal key name, late)."""
    import torch.distributed.checkpoint as dcp

    from megatron_rl.rl.checkpoint.resume_fit import check_resume_dtype

    dcp.save({"model": {"w": torch.zeros(2, dtype=saved)}, "optim": {"x": torch.zeros(1)}},
             checkpoint_id=str(tmp_path), no_dist=True)
    name = str(saved).removeprefix("torch.")
    check_resume_dtype(tmp_path, name)
    with pytest.raises(CheckpointError, match=f"saved in {name}, config dtype {dtype}; a run resumes in the dtype "
                                              f"it was saved in \\(set dtype: {name}\\)"):
        check_resume_dtype(tmp_path, dtype)


def test_a_bad_data_position_on_resume_is_refused_before_the_ranks(tmp_path):
    """The prompt iterator's saved state is checked on the driver, naming the file and the field
    (a missing field was a bare KeyError inside every rank)."""
    import torch.distributed.checkpoint as dcp

    from megatron_rl.config import load_dataclass
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.data.tokenizer import build_tokenizer
    from megatron_rl.rl.checkpoint.resume_fit import check_resume_fit
    from megatron_rl.trainer_config import TrainerConfig

    cfg = load_dataclass(TrainerConfig, "examples/tiny_cpu_grpo.yaml", {})
    data = load_prompts(cfg.data)
    dcp.save({"model": {"w": torch.zeros(2, dtype=getattr(torch, cfg.dtype))}}, checkpoint_id=str(tmp_path),
             no_dist=True)
    good = {"epoch": 0, "position": cfg.prompts_per_step, "seed": cfg.seed, "num_prompts": len(data),
            "batch_size": cfg.prompts_per_step, "shuffle": True}
    check_resume_fit(cfg, data, build_tokenizer(cfg.tokenizer), tmp_path, {"step": 1, "data": good})
    with pytest.raises(FlexFloorError, match=f"^{tmp_path / 'trainer_state.json'}: data position field "
                                             "'position': expected int, got nothing"):
        check_resume_fit(cfg, data, build_tokenizer(cfg.tokenizer), tmp_path,
                         {"step": 1, "data": {k: v for k, v in good.items() if k != "position"}})


def test_resume_step_moves_latest_before_anything_is_truncated(run_folder, tmp_path, capsys, monkeypatch):
    """A crash after `--resume-step 1` truncated metrics.jsonl left `latest` on
    step 2, whose metrics line was then gone for good. The ranks are replaced by a crash."""
    from megatron_rl.errors import FlexFloorError
    from megatron_rl.metrics.logger import _drop_steps_after
    from tests.tiny_train import tiny_train_config

    def crash(*a, **k):
        raise FlexFloorError("the node died")

    monkeypatch.setattr("megatron_rl.train_driver.run_ranks", crash)
    cfg = tiny_train_config(tmp_path, steps=3)
    _one_line_exit_2(capsys, ["train", "--config", cfg, "--out", run_folder, "--resume-step", "1"], "the node died")
    assert (run_folder / "checkpoints" / "latest").read_text() == "step_000001"
    metrics = run_folder / "metrics.jsonl"

    def torn(*a):  # the rewrite dies before its rename: the old file stays whole
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("os.fsync", torn)
    with pytest.raises(OSError):
        _drop_steps_after(metrics, 1)
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2]
    monkeypatch.undo()
    _drop_steps_after(metrics, 1)
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1]
    assert not [p for p in run_folder.iterdir() if ".tmp" in p.name]


def test_a_refused_train_leaves_nothing_in_a_folder_it_created(cfg, tmp_path, capsys):
    """Neither --out/checkpoints/ nor .flexfloor.lock stays behind (both did)."""
    data = tmp_path / "noanswer.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(8)))
    new, refused = tmp_path / "new" / "run", "no row has a reference answer"
    _one_line_exit_2(capsys, ["train", "--config", cfg, "--out", new, f"data.path={data}"], refused)
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    _one_line_exit_2(capsys, ["train", "--config", cfg, "--out", mine, f"data.path={data}"], refused)
    assert _listing(mine) == ["notes.txt"]


def test_a_full_disk_is_one_line_exit_1_wherever_it_is_met(cfg, tmp_path, capsys, monkeypatch):
    """On the driver (its config.yaml) or on a rank (the launcher's DiskFull): one line naming the
    path, exit 1 (the inputs were fine), never a traceback."""
    out = tmp_path / "out"

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "config.yaml"))

    def rank_full(*a, **k):
        raise DiskFull(errno.ENOSPC, "No space left on device", str(out))

    for patched, path in ((("megatron_rl.train_driver.write_config", full), out / "config.yaml"),
                          (("megatron_rl.train_driver.run_ranks", rank_full), out)):
        with monkeypatch.context() as m:
            m.setattr(*patched)
            rc = main(["train", "--config", str(cfg), "--out", str(out)])
        lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[")]
        assert rc == 1 and lines == [f"flexfloor train: error: no space left on device: {path}"], (rc, lines)
