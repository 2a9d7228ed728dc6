"""`flexfloor demo`: bad configs, flags and overrides are one line naming the file, field or flag,
exit 2, before any rank starts."""


def test_bad_input_is_one_line_exit_2_before_any_rank(files, refuses_each):
    latin1_yaml, tmp = files.latin1_yaml, files.tmp
    refuses_each("demo", [
        (["--json", str(tmp / "missing" / "d.json")], [f"--json {tmp / 'missing' / 'd.json'}: folder",
                                                       "does not exist"]),
        (["--ranks", "3"], ["--ranks 3:", "expected a multiple of ranks (3)"]),
        (["--config", latin1_yaml], [f"{latin1_yaml}:2: not UTF-8 text"]),
        (["batch.prompts=many"], ["batch.prompts=many: batch.prompts: expected an integer"]),
    ])
