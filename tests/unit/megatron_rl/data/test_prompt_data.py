import json

import pytest

from megatron_rl.data import DataConfig, DatasetError, PromptIterator, load_prompts
from megatron_rl.data.arith import make_problems, write_jsonl
from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.errors import FlexFloorError


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_rows_become_prompts(tmp_path):
    p = _write(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": 2, "level": 1}, {"prompt": "2+2="}])
    ds = load_prompts(DataConfig(str(p), template="Q: {prompt}"))
    assert [q.prompt_id for q in ds] == ["d-00000", "d-00001"]
    assert ds[0].text == "Q: 1+1=" and ds[0].answer == "2" and ds[0].extra == {"level": 1}
    assert ds[1].answer is None


def test_missing_prompt_is_an_error_naming_file_and_line(tmp_path):
    p = _write(tmp_path / "d.jsonl", [{"prompt": "a"}, {"question": "b"}])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: missing prompt field 'prompt'"):
        load_prompts(DataConfig(str(p)))


def test_missing_prompt_can_be_a_counted_skip(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a"}\n{"prompt": null}\nnot json\n{"prompt": "c"}\n')
    ds = load_prompts(DataConfig(str(p), on_bad_row="skip"))
    assert [q.text for q in ds] == ["a", "c"]
    assert ds.skipped == 2 and ds.skipped_rows[1][0].endswith("d.jsonl:3")


def test_duplicate_ids_are_rejected(tmp_path):
    p = _write(tmp_path / "d.jsonl", [{"prompt_id": "x", "prompt": "a"}, {"prompt_id": "x", "prompt": "b"}])
    with pytest.raises(DatasetError, match="duplicate prompt_id 'x'"):
        load_prompts(DataConfig(str(p)))


def test_hf_parquet_and_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"problem": "1+1", "solution": "2"}, {"problem": None, "solution": "3"}])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "saved"))
    cfg = {"prompt_field": "problem", "answer_field": "solution"}
    with pytest.raises(DatasetError, match=r"d\.parquet row 1: missing prompt field 'problem'"):
        load_prompts(DataConfig(str(tmp_path / "d.parquet"), **cfg))
    got = load_prompts(DataConfig(str(tmp_path / "saved"), split="test", on_bad_row="skip", **cfg))
    assert [(q.text, q.answer) for q in got] == [("1+1", "2")] and got.skipped == 1
    with pytest.raises(DatasetError, match="no split 'train'"):
        load_prompts(DataConfig(str(tmp_path / "saved"), **cfg))


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset"):
        load_prompts(DataConfig(str(tmp_path / "nope.jsonl")))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DatasetError, match="unknown dataset format"):
        load_prompts(DataConfig(str(tmp_path / "d.txt")))


def test_iterator_is_deterministic_resumable_and_epoch_aligned():
    it = PromptIterator(10, 3, seed=7)
    seen = [it.next_batch() for _ in range(4)]
    assert [b.epoch for b in seen] == [0, 0, 0, 1]
    first_epoch = [i for b in seen[:3] for i in b.indices]
    assert len(set(first_epoch)) == 9  # one prompt of 10 sits the epoch out
    state = it.state_dict()
    rest = [it.next_batch().indices for _ in range(5)]
    again = PromptIterator(10, 3, seed=7)
    again.load_state_dict(state)
    assert [again.next_batch().indices for _ in range(5)] == rest
    assert PromptIterator(10, 3, seed=8).next_batch().indices != seen[0].indices


def test_iterator_refuses_a_state_from_other_data():
    state = PromptIterator(10, 3, seed=7).state_dict()
    with pytest.raises(FlexFloorError, match="num_prompts=10"):
        PromptIterator(12, 3, seed=7).load_state_dict(state)


@pytest.mark.parametrize("edit, expect", [
    ({"position": None}, r"run/trainer_state.json: data position field 'position': expected int, got nothing"),
    ({"epoch": "2"}, r"field 'epoch': expected int, got '2'"),
    ({"shuffle": 1}, r"field 'shuffle': expected bool, got 1"),
    ({"position": 11}, r"expected epoch >= 0 and position 0 to 10, got epoch 0, position 11"),
    ({"epoch": -1}, r"got epoch -1"),
])
def test_a_bad_data_position_is_one_line_naming_file_and_field(edit, expect):
    state = PromptIterator(10, 3, seed=7).state_dict()
    for key, value in edit.items():
        state.pop(key) if value is None else state.__setitem__(key, value)
    with pytest.raises(FlexFloorError, match=expect):
        PromptIterator(10, 3, seed=7).load_state_dict(state, source="run/trainer_state.json")


def test_char_tokenizer_round_trip_and_unknown_char():
    tok = CharTokenizer()
    ids = tok.encode("12+7=")
    assert ids[0] == tok.bos_id and tok.decode(ids + tok.encode("19")[1:] + [tok.eos_id, 5]) == "12+7=19"
    with pytest.raises(FlexFloorError, match="'x'"):
        tok.encode("1x")


def test_arith_problems_are_distinct_and_correct(tmp_path):
    rows = make_problems(50, seed=1, max_operand=9, ops="+-")
    assert len({r["prompt"] for r in rows}) == 50
    for r in rows:
        assert str(eval(r["prompt"][:-1])) == r["answer"]
    write_jsonl(rows, tmp_path / "a.jsonl")
    assert len(load_prompts(DataConfig(str(tmp_path / "a.jsonl")))) == 50
    with pytest.raises(FlexFloorError, match="cannot draw"):
        make_problems(101, seed=1, max_operand=9, ops="+")
