"""`tokenizer: kind: hf` on a local tokenizer directory (built here: no download)."""
import pytest

from megatron_rl.data.tokenizer import HFTokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "what", "is", "2+2", "?", "4"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                  additional_special_tokens=["<|user|>", "<|assistant|>"])
    tok.chat_template = ("{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    path = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(path)
    return str(path)


def test_chat_template_encode_returns_plain_ids(tokenizer_dir):
    tok = HFTokenizer(tokenizer_dir, chat_template=True)
    ids = tok.encode("what is 2+2 ?")
    assert ids == [2, 4, 5, 6, 7, 3] and all(type(i) is int for i in ids)
    assert tok.decode(ids) == "what is 2+2 ?"  # specials (the template's markers) dropped


def test_plain_encode_and_response(tokenizer_dir):
    tok = HFTokenizer(tokenizer_dir, chat_template=False)
    assert tok.encode("what is") == [4, 5] and tok.encode_response("4") == [8, tok.eos_id]


def test_a_verl_prompt_goes_through_the_chat_template_whole(tokenizer_dir):
    """Every message of a verl row (a system turn too) is rendered, with the generation prompt."""
    from megatron_rl.data.prompts import Prompt

    messages = ({"role": "system", "content": "what is"}, {"role": "user", "content": "2+2 ?"})
    p = Prompt("q", "2+2 ?", "4", messages=messages)
    assert HFTokenizer(tokenizer_dir, chat_template=True).encode_prompt(p) == [2, 4, 5, 2, 6, 7, 3]
    assert HFTokenizer(tokenizer_dir, chat_template=False).encode_prompt(p) == [6, 7]


def test_an_export_carries_the_hf_tokenizer_and_its_ids(tokenizer_dir, tmp_path):
    """The export holds the run's tokenizer files and its eos/pad ids."""
    import json

    from transformers import AutoTokenizer

    from megatron_rl.models import MoEModelConfig, Qwen3MoeModel, save_hf_checkpoint

    model = Qwen3MoeModel(MoEModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1,
                                         kv_channels=8, num_moe_experts=2, moe_router_topk=1,
                                         moe_ffn_hidden_size=8, vocab_size=9))
    tok = HFTokenizer(tokenizer_dir)
    save_hf_checkpoint(model, tmp_path / "hf", tokenizer=tok)
    again = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert again.encode("what is 2+2 ?") == tok._tok.encode("what is 2+2 ?")
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_id == 1 and gen["pad_token_id"] == 0 and "bos_token_id" not in gen
