"""Every Python process started with this folder on PYTHONPATH (the ranks a harness test spawns,
its `flexfloor` subprocesses) runs under tests/megatron_harness.py. Tests only."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megatron_harness  # noqa: E402

megatron_harness.install()
