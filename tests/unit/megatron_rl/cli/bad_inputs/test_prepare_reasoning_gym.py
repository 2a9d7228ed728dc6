"""`tools/prepare_reasoning_gym.py` owns only what it creates (the rule of `export --to`): a folder
of the user's is refused and left as it is (it overwrote reward.py and train.parquet); counts are
positive (0 or -3 wrote an empty set and exited 0); a bad task or `--params` is one line listing
the choices (they were tracebacks). Each refusal: one line, exit 2."""
import runpy
import sys

import pytest

pytest.importorskip("reasoning_gym")
pytest.importorskip("datasets")

TOOL = "tools/prepare_reasoning_gym.py"


def run(capsys, *argv) -> tuple[int, list[str]]:
    sys.argv = ["prepare_reasoning_gym.py", *argv]
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(TOOL, run_name="__main__")
    err = [line for line in capsys.readouterr().err.splitlines() if "Creating parquet" not in line]
    return stop.value.code, err


def test_bad_counts_tasks_and_params_are_one_line_listing_the_choices(tmp_path, capsys):
    out = str(tmp_path / "out")
    base = ["--task", "basic_arithmetic", "--out", out]
    for argv, words in [
        (["--task", "nope", "--out", out], ["--task nope: not a reasoning-gym task; the tasks: ab, ",
                                            "basic_arithmetic, "]),
        ([*base, "--train", "0"], ["--train 0: expected a positive number of rows"]),
        ([*base, "--heldout", "-3"], ["--heldout -3: expected a positive number of rows"]),
        ([*base, "--params", '{"x": 1}'], ["--params: basic_arithmetic has no field 'x'", "its fields: min_terms, "]),
        ([*base, "--params", '{"size": 3}'], ["has no field 'size' (seed and size are --seed's and --train's)"]),
        ([*base, "--params", "{"], ["--params: not JSON (", "expected an object of basic_arithmetic's fields: "]),
        ([*base, "--params", "[1]"], ["--params: expected a JSON object of basic_arithmetic's fields (min_terms"]),
        ([*base, "--params", '{"min_terms": -1}'], ['--params {"min_terms": -1}: basic_arithmetic refused them '
                                                    "(AssertionError: min_terms must be positive); its fields: "]),
    ]:
        rc, err = run(capsys, *argv)
        assert rc == 2 and len(err) == 1, (argv, rc, err)
        assert err[0].startswith("prepare_reasoning_gym: error: ") and all(w in err[0] for w in words), (argv, err)
    assert not (tmp_path / "out").exists()


def test_it_replaces_only_a_folder_it_wrote(tmp_path, capsys):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "reward.py").write_text("# my own reward\n")
    (theirs / "train.parquet").write_bytes(b"mine")
    rc, err = run(capsys, "--task", "basic_arithmetic", "--out", str(theirs), "--train", "4", "--heldout", "4")
    assert rc == 2 and len(err) == 1 and err[0].startswith(
        f"prepare_reasoning_gym: error: --out {theirs}: is a non-empty folder that is not a FlexFloor export")
    assert (theirs / "reward.py").read_text() == "# my own reward\n"
    assert (theirs / "train.parquet").read_bytes() == b"mine"
    ours = tmp_path / "ours"
    for n in (4, 6):  # a second run replaces the first's folder whole
        rc, _ = run(capsys, "--task", "basic_arithmetic", "--out", str(ours), "--train", str(n), "--heldout", "4")
        assert rc == 0
    import datasets

    assert len(datasets.Dataset.from_parquet(str(ours / "train.parquet"))) == 6
    assert sorted(p.name for p in ours.iterdir()) == [".flexfloor-export", "heldout.parquet", "reward.py",
                                                      "train.parquet"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours", "theirs"]  # no temporary folder left
