"""`flexfloor plan`: bad traces and flags are one line naming the file, field or flag, exit 2."""
from tests.helpers.traces import write_flat_trace


def test_bad_input_is_one_line_exit_2_before_any_rank(files, refuses_each):
    latin1_trace, trace = files.latin1_trace, files.trace
    refuses_each("plan", [
        (["--trace", trace, "--max-response-len", "-5"], ["--max-response-len -5: max_response_len: expected > 0"]),
        (["--trace", trace, "--max-response-len", "0"], ["--max-response-len 0: max_response_len: expected > 0"]),
        (["--trace", trace, "--ranks", "1000"], ["--ranks 1000: ranks: expected at most the experts of"]),
        (["--trace", latin1_trace], [f"{latin1_trace}:2: not UTF-8 text"]),
        (["--trace", trace, "--ranks", "8", "--floor", "0"], ["floor: expected 1..ranks"]),
        (["--trace", trace, "--ranks", "8", "--epoch", "0"], ["--max-response-len"]),
        (["--trace", trace, "--ranks", "8", "--epoch", "7"], ["no records for epoch 7"]),
    ])


def test_a_value_that_would_hang_or_crash_is_one_line(tmp_path, refuses_value):
    trace = write_flat_trace(tmp_path / "t.jsonl")
    refuses_value(["plan", "--trace", trace, "--ranks", "4", "--floor", "2"],
                  "seed=-1", "seed: expected an integer in [0, 2^32)")
