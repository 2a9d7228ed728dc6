"""Helpers the test files share, one home each: running the CLI (cli.py), the synthetic traces
(traces.py), training runs and their metrics (train.py)."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
