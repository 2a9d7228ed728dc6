"""`flexfloor --help` and every command's `--help` stay instant: building the parser (every command's
flags, megatron_rl/cli/) imports neither torch nor numpy; a command's run module
(megatron_rl/commands/) is imported only once the command is parsed."""
import subprocess
import sys

from tests.helpers import REPO

PROBE = """
import sys
from megatron_rl.cli import build_parser
parser = build_parser()
for command in ("demo", "rollout", "plan", "predict", "simulate", "train", "export"):
    try:
        parser.parse_args([command, "--help"])
    except SystemExit:
        pass
heavy = sorted(m for m in ("torch", "numpy", "megatron_rl.commands.train") if m in sys.modules)
print(",".join(heavy) or "none")
"""


def test_every_help_imports_neither_torch_nor_numpy():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.strip().splitlines()[-1] == "none", out[-2000:]
