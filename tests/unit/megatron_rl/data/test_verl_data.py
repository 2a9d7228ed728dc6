"""verl-format datasets load unchanged: the layout of verl's examples/data_preprocess/gsm8k.py
(parquet written by `datasets`, `prompt` a list of chat messages, the answer at
`reward_model.ground_truth`), with no option but the path; bad rows are one line each."""
import pytest

from megatron_rl.data import DataConfig, DatasetError, load_prompts
from megatron_rl.data.tokenizer import CharTokenizer

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_row(idx: int, question: str, answer_raw: str, split: str = "train") -> dict:
    """verl's gsm8k `process_fn`, field for field."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer_raw.split("#### ")[-1].replace(",", "")},
        "extra_info": {"split": split, "index": idx, "answer": answer_raw, "question": question},
    }


def write_parquet(path, rows):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_gsm8k_layout_loads_with_only_its_path(tmp_path):
    rows = [gsm8k_row(0, "Tom has 3 apples and buys 4. How many?", "3+4=7\n#### 7"),
            gsm8k_row(1, "A box of 1,000 pens.", "#### 1,000")]
    ds = load_prompts(DataConfig(str(write_parquet(tmp_path / "train.parquet", rows))))
    first = ds[0]
    assert first.answer == "7" and ds[1].answer == "1000"
    assert first.data_source == "openai/gsm8k"
    assert first.messages == ({"role": "user", "content": rows[0]["prompt"][0]["content"]},)
    assert first.text == rows[0]["prompt"][0]["content"]  # no chat template: the last user turn
    assert first.extra_info == rows[0]["extra_info"] and first.extra["ability"] == "math"
    assert [p.prompt_id for p in ds] == ["train-00000", "train-00001"]


def test_template_fills_the_last_user_message_and_dotted_fields_name_ids(tmp_path):
    row = gsm8k_row(7, "1+1", "#### 2")
    row["prompt"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1"}]
    path = write_parquet(tmp_path / "d.parquet", [row])
    p = load_prompts(DataConfig(str(path), template="{prompt}=", id_field="extra_info.index"))[0]
    assert p.text == "1+1=" and p.prompt_id == "7" and len(p.messages) == 2
    assert CharTokenizer().encode_prompt(p) == CharTokenizer().encode("1+1=")


def test_bad_verl_rows_are_one_line_each_naming_file_and_row(tmp_path):
    no_answer = gsm8k_row(1, "2+2", "#### 4")
    no_answer["reward_model"] = {"style": "rule", "ground_truth": ""}
    no_user = gsm8k_row(2, "3+3", "#### 6")
    no_user["prompt"] = [{"role": "system", "content": "hi"}]
    rows = [gsm8k_row(0, "1+1", "#### 2"), no_answer, no_user, gsm8k_row(0, "5+5", "#### 10")]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DatasetError, match=r"bad\.parquet row 1: no answer at 'reward_model\.ground_truth'"):
        load_prompts(DataConfig(str(path)))
    ds = load_prompts(DataConfig(str(path), on_bad_row="skip", id_field="extra_info.index"))
    reasons = [r for _, r in ds.skipped_rows]
    assert len(ds) == 1 and len(reasons) == 3 and all("\n" not in r for r in reasons)
    assert "row 2: prompt has no user message" in reasons[1]
    assert "row 3: duplicate prompt_id '0', first at" in reasons[2]
    with pytest.raises(DatasetError, match="data.format verl"):
        load_prompts(DataConfig(str(write_parquet(tmp_path / "p.parquet", [{"prompt": "1+1", "answer": "2"}])),
                                format="verl"))


def test_a_verl_prompt_too_long_for_the_positions_names_its_row(tmp_path):
    from megatron_rl.errors import FlexFloorError
    from megatron_rl.rl.input_checks import check_data
    from megatron_rl.trainer_config import TrainerConfig

    rows = [gsm8k_row(i, "1+1", "#### 2") for i in range(8)] + [gsm8k_row(8, "1" * 80, "#### 1")]
    for r in rows:
        r["prompt"][0]["content"] = r["extra_info"]["question"]
    path = write_parquet(tmp_path / "long.parquet", rows)
    cfg = TrainerConfig(data=DataConfig(str(path)))
    cfg.model.max_position_embeddings = 64
    with pytest.raises(FlexFloorError, match=r"long\.parquet row 8: prompt of 81 tokens"):
        check_data(cfg, load_prompts(cfg.data), CharTokenizer())
