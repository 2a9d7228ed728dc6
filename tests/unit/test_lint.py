import shutil
import subprocess

import pytest

from tests.helpers import REPO


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the dev extra: pip install -e '.[dev]'")
def test_ruff_is_clean():
    root = REPO
    out = subprocess.run(["ruff", "check", "--output-format", "concise", str(root)],
                         capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr
