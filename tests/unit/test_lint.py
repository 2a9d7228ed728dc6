import shutil
import subprocess
from pathlib import Path

import pytest


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the dev extra: pip install -e '.[dev]'")
def test_ruff_is_clean():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(["ruff", "check", "--output-format", "concise", str(root)],
                         capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr
