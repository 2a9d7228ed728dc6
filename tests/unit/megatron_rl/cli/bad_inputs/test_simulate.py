"""`flexfloor simulate`: bad traces, cost files, flags and plot folders are one line naming the
file, field or flag, exit 2."""
from tests.helpers.traces import write_flat_trace


def test_bad_input_is_one_line_exit_2_before_any_rank(files, refuses_each):
    w, latin1_yaml, latin1_trace, a_file, loop, long, too_long, planted, trace = (
        files.w, files.latin1_yaml, files.latin1_trace, files.a_file, files.loop, files.long, files.too_long,
        files.planted, files.trace)
    refuses_each("simulate", [
        (["--trace", latin1_trace], [f"{latin1_trace}:2: not UTF-8 text"]),
        (["--trace", trace, "--cost", latin1_yaml], [f"{latin1_yaml}:2: not UTF-8 text"]),
        (["--trace", trace, "--plot", a_file], [f"--plot {a_file}: exists and is not a folder"]),
        (["--trace", trace, "--plot", str(loop)], [f"--plot {loop}: a symlink loop"]),
        (["--trace", trace, "--plot", str(planted)], [f"--plot {planted}: report.json: a symlink to"]),
        (["--trace", trace, "--plot", f"{long}/figs"], [too_long]),
        (["--trace", trace, "--floor", "0"], ["--floor 0: floor: expected 1..ranks (16)"]),
        (["--trace", "missing.jsonl"], ["missing.jsonl"]),
        (["--trace", trace, "--epochs", "0"], ["--epochs"]),
        (["--trace", trace, "--cost", w("cost.yaml", "step_overhead: 0.01\n")], ["cost.yaml", "step_overhead"]),
    ])


def test_a_value_that_would_hang_or_crash_is_one_line(tmp_path, refuses_value):
    trace = write_flat_trace(tmp_path / "t.jsonl")
    refuses_value(["simulate", "--trace", trace, "--ranks", "4", "--floor", "2"],
                  "cost.step_overhead_s=.inf", "expected a finite number")
