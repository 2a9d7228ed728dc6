"""`flexfloor demo` as a user runs it: a subprocess, its printed comparison and its `--json` file."""
import json

import pytest

from tests.helpers.cli import cli

pytestmark = pytest.mark.timeout(300)


def test_demo_json_holds_both_reports(tmp_path):
    out = tmp_path / "demo.json"
    r = cli("demo", "--quiet", "--length-scale", 0.02, "--json", out, expect=0)
    reports = json.loads(out.read_text())
    assert sorted(reports) == ["planned", "vanilla"]
    van, flex = reports["vanilla"], reports["planned"]
    assert (van["policy"], flex["policy"]) == ("vanilla", "planned") and flex["tailguard"]
    # Each as `flexfloor rollout --json` writes it: the ledger and the responses' hash.
    for rep in (van, flex):
        assert rep["ranks"] == 4 and sum(rep["rank_steps"].values()) == 4 * rep["rollout_steps"]
    assert van["responses_sha256"] == flex["responses_sha256"]
    assert f"identical responses: True (sha256 {van['responses_sha256'][:16]}" in r.stdout
