import json
import os
import struct
from contextlib import contextmanager

import pytest
import torch

from tests.helpers.traces import write_tailed_trace

# The tiny models gain nothing from intra-op threads, and OpenMP threads spinning against the gloo
# ranks that distributed tests spawn on the same 2 cores make everything many times slower.
torch.set_num_threads(1)

# A loaded machine (CI's 2 cores shared with other jobs) runs every test slower, those that spawn
# ranks most (a DeepSpeed JIT build took 555 s at load 13 for 149 s of CPU): each test's time bound
# (its `timeout` marker, else pytest.ini's) grows with the load average per core, at most 3x, so a
# hang still ends.
MAX_LOAD_SCALE = 3.0


def load_scale() -> float:
    return min(MAX_LOAD_SCALE, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def pytest_report_header(config):
    return f"time bounds x{load_scale():.2f} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"


def pytest_collection_modifyitems(config, items):
    scale = load_scale()
    if scale == 1.0:
        return
    try:
        default = float(config.getini("timeout") or 0)
    except ValueError:  # no pytest-timeout (the bare GPU image's pytest, tools/gpu_check.sh): no bound to scale
        return
    for item in items:
        marker = item.get_closest_marker("timeout")
        args, kwargs = (list(marker.args), dict(marker.kwargs)) if marker else ([], {})
        base = args[0] if args else kwargs.pop("timeout", default)
        if base:  # 0 or None: no bound to scale
            item.add_marker(pytest.mark.timeout(float(base) * scale, *args[1:], **kwargs), append=False)


@pytest.fixture(scope="module")
def tailed_trace(tmp_path_factory):
    return write_tailed_trace(tmp_path_factory.mktemp("trace") / "trace.jsonl")


@pytest.fixture
def megatron_harness(monkeypatch):
    """megatron-core's real layers on CPU (tests/megatron_harness.py): patched in this process and,
    through PYTHONPATH, in every rank or `flexfloor` process the test starts."""
    import megatron_harness as harness

    harness.install()
    monkeypatch.setenv("PYTHONPATH", harness.site_env()["PYTHONPATH"])
    try:
        yield harness
    finally:
        harness.uninstall()


@pytest.fixture
def one_rank_group(request):
    """A one-rank torch.distributed world and a group of that rank, torn down after the test.

    The backend is the test module's `DIST_BACKEND` (default gloo; nccl for GPU tests).
    """
    from datetime import timedelta

    import torch.distributed as dist

    backend = getattr(request.module, "DIST_BACKEND", "gloo")
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


def wandb_records(run_file, kind):
    """The records of one type (`history`, `metric`, `run`, ...) of an offline W&B run file.

    wandb 0.31 reads these files only in its Go core; this follows their LevelDB log framing
    (32 KiB blocks, 7-byte chunk headers) behind the `:W&B` header and parses the chunks with
    wandb's own protobuf classes.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    out, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block tail too short for a header is padding
            pos += block - pos % block
            continue
        length, chunk_type = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if chunk_type == 0:
            break
        pending = chunk if chunk_type in (1, 2) else pending + chunk
        if chunk_type in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            if rec.WhichOneof("record_type") == kind:
                out.append(getattr(rec, kind))
    return out


def wandb_history(run_file):
    """The `history` rows of an offline W&B run file, as {key: value} dicts."""
    return [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in h.item}
            for h in wandb_records(run_file, "history")]


def documented_keys():
    """The metric keys of docs/training.md's table, as fnmatch patterns (`<state>` -> `*`)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    first_cells = re.findall(r"^\| (`[^|]+)\|", section, re.M)
    return [re.sub(r"<[^>]+>", "*", key) for cell in first_cells for key in re.findall(r"`([^`]+)`", cell)]


def write_tiny_sidecar(folder, queries=24):
    """A sidecar's inputs on disk: a HuggingFace checkpoint (random weights: for tests of serving,
    not of skill; tools/make_sidecar_model.py makes a trained one) and held-out arithmetic queries."""
    from megatron_rl.data.arith import make_problems, write_jsonl
    from megatron_rl.models import Qwen3MoeModel, save_hf_checkpoint
    from megatron_rl.models.config import MoEModelConfig

    model = Qwen3MoeModel(MoEModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                         num_query_groups=2, kv_channels=8, num_moe_experts=2,
                                         moe_router_topk=1, moe_ffn_hidden_size=16, vocab_size=20))
    model.init_weights(3)
    save_hf_checkpoint(model, folder / "model")
    write_jsonl(make_problems(queries, seed=1, max_operand=9), folder / "queries.jsonl")
    return str(folder / "model"), str(folder / "queries.jsonl")


def check_timeline(report: dict):
    """A rollout report's per-rank timeline conserves its ledger (elastic/timeline.py): per rank and
    state, the segments' seconds sum to the ledger's rank-seconds and their steps to its steps.
    Returns the timeline."""
    from elastic.ledger import Ledger, RankLedger
    from elastic.timeline import Timeline

    ledger = Ledger([RankLedger.from_dict({k: v for k, v in d.items() if k != "timeline"})
                     for d in report["per_rank"]], report["rollout_time_s"], report["rollout_steps"])
    ledger.check()
    timeline = Timeline.of_report(report)
    timeline.check(ledger)
    assert {s: sum(r.seconds[s] for r in ledger.ranks) for s in ledger.ranks[0].seconds} == report["rank_seconds"]
    return timeline


@contextmanager
def running(bed, unavailable: type[Exception], reason: str):
    """`bed.start()`, or skip the test with `reason` and why when it raises `unavailable`; yields
    the started bed and `bed.stop()`s it after, whatever happened."""
    try:
        bed.start()
    except unavailable as e:
        pytest.skip(f"{reason}: {e}")
    try:
        yield bed
    finally:
        bed.stop()
