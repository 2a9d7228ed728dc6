"""A tokenizer's chat template is the user's input: every jinja error, sandbox refusal, empty or
over-long render, and a render that runs out of time or memory is one line naming the row, the
template's file and the cause, exit 2, before any rank starts (they were raw jinja tracebacks, an
empty template crashed the ranks in decode, and a pathological one grew to GBs on the driver)."""
import json

import pytest

from megatron_rl.data.chat_template import FIRST_ROWS
from megatron_rl.data.prompts import Prompt
from megatron_rl.data.tokenizer import HFTokenizer
from tests.tiny_train import tiny_train_config

pytest.importorskip("transformers")

GOOD = ("{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tokenizer_dir(folder, template: str | None):
    """A word-level tokenizer saved with `template` as its chat template (None: without one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "1+1=", "2", "boom"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                  additional_special_tokens=["<|user|>", "<|assistant|>"])
    tok.chat_template = template
    folder.mkdir(parents=True)
    tok.save_pretrained(folder)
    return folder


def _cfg(tmp_path, name, template, rows=None):
    folder = tmp_path / name
    tok = tokenizer_dir(folder / "tok", template)
    cfg = tiny_train_config(folder, tokenizer={"kind": "hf", "path": str(tok)})
    if rows is not None:
        data = folder / "data.jsonl"
        data.write_text("".join(json.dumps({"prompt": r, "answer": "2"}) + "\n" for r in rows))
    return ["--config", str(cfg)], folder


def test_a_template_that_fails_to_render_is_one_line_naming_row_file_and_cause(tmp_path, refuses_each, monkeypatch):
    # Long enough that the other cases finish on a loaded machine ('x' * 10**7 under load took over
    # 1 s), short enough that the endless loop costs little.
    monkeypatch.setattr("megatron_rl.data.chat_template.RENDER_S", 4.0)
    cases = [
        ("syntax", "{% for m in messages %}", "chat template: TemplateSyntaxError: Unexpected end of template"),
        ("raises", "{{ raise_exception('no system turns, please') }}", "chat template: TemplateError: no system "
                                                                       "turns, please"),
        ("undefined", "{{ foo.bar }}", "chat template: UndefinedError: 'foo' is undefined"),
        ("sandbox", "{{ ''.__class__.__mro__[1].__subclasses__() }}",
         "chat template: SecurityError: access to attribute '__class__' of 'str' object is unsafe"),
        ("include", "{% include 'other.jinja' %}", "chat template: TypeError: no loader for this environment"),
        ("arith", "{{ 1 / 0 }}", "chat template: ZeroDivisionError: division by zero"),
        ("empty_render", "{% if false %}x{% endif %}", "the chat template rendered an empty prompt"),
        ("long", "{{ 'x' * 10**7 }}", "chat template: rendered 10000000 characters, more than 64 a position for "
                                      "model.max_position_embeddings could hold (262144)"),
        ("memory", "{{ 'x' * 10**11 }}", "chat template: MemoryError (past the 2 GiB a render may use)"),
        ("loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
         "chat template: rendering did not finish within 4 s"),
    ]
    checks = []
    for name, template, cause in cases:
        argv, folder = _cfg(tmp_path, name, template)
        checks.append((argv, [f"{folder / 'data.jsonl'}:1: {folder / 'tok' / 'chat_template.jinja'}: ", cause]))
    argv, folder = _cfg(tmp_path, "none", None)
    checks.append((argv, [f"tokenizer.path {folder / 'tok'}: has no chat template",
                          "set tokenizer.chat_template: false"]))
    refuses_each("train", checks)


def test_a_later_row_that_breaks_the_template_is_one_line_too(tmp_path, refuses_each):
    """Rows past the bounded first ones are rendered on the driver as the ranks render them."""
    template = "{% if 'boom' in messages[0]['content'] %}{{ raise_exception('boom') }}{% endif %}" + GOOD
    rows = ["1+1="] * (FIRST_ROWS + 2) + ["boom"]
    argv, folder = _cfg(tmp_path, "later", template, rows)
    refuses_each("train", [(argv, [f"{folder / 'data.jsonl'}:{len(rows)}: {folder / 'tok' / 'chat_template.jinja'}: "
                                   "chat template: TemplateError: boom"])])


def test_a_good_template_renders_as_before(tmp_path):
    tok = HFTokenizer(str(tokenizer_dir(tmp_path / "tok", GOOD)))
    p = Prompt("q", "1+1=", "2")
    assert tok.encode_prompt(p) == [2, 4, 3] and tok.render_prompt(p) == "<|user|> 1+1= <|assistant|>"


def test_the_bounded_check_passes_a_good_template(tmp_path):
    from megatron_rl.data.chat_template import check_chat_template

    tok = HFTokenizer(str(tokenizer_dir(tmp_path / "tok", GOOD)))
    check_chat_template(tok, [Prompt("q", "1+1=", "2", where="d.jsonl:1")] * 3, 16)
