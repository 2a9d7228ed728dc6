"""Tokenizers behind one small interface: a character-level one for the CPU tasks, HF for real models.

The trainer and the rollout engine need only `encode_prompt` (a dataset's `Prompt`), `encode`,
`decode`, `eos_id`, `pad_id` and `vocab_size`. The character tokenizer has a fixed alphabet
chosen in the config, so its ids do not depend on the data; a character outside the alphabet is
an error naming it, not a silent <unk>.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from megatron_rl.config import require
from megatron_rl.errors import FlexFloorError
from megatron_rl.user_code.loader import failure

SPECIALS = ("<pad>", "<bos>", "<eos>")
DEFAULT_ALPHABET = "0123456789+-*=() "


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, prompt) -> list[int]:
        """Ids of a dataset `Prompt`: its chat messages through a chat template where there is one,
        else its text."""

    def encode_response(self, text: str) -> list[int]:
        """Ids of `text` as a complete response: no BOS, ending with EOS (SFT targets)."""

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class TokenizerConfig:
    kind: Literal["char", "hf"] = "char"
    # char: the characters after the special tokens <pad>=0, <bos>=1, <eos>=2.
    alphabet: str = DEFAULT_ALPHABET
    # hf: a local directory with tokenizer files (no hub download).
    path: str | None = None
    # hf: wrap each prompt in the tokenizer's chat template as a single user turn.
    chat_template: bool = True

    def __post_init__(self) -> None:
        if self.kind == "char":
            require(len(set(self.alphabet)) == len(self.alphabet) > 0,
                    f"tokenizer.alphabet: expected distinct characters, got {self.alphabet!r}")
        else:
            require(bool(self.path), "tokenizer.path: kind 'hf' needs a local tokenizer directory")


class CharTokenizer:
    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        self.alphabet = alphabet
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._ids = {c: i + len(SPECIALS) for i, c in enumerate(alphabet)}
        self.vocab_size = len(SPECIALS) + len(alphabet)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.bos_id] + [self._ids[c] for c in text]
        except KeyError as e:
            raise FlexFloorError(
                f"character {e.args[0]!r} in {text!r} is not in the tokenizer alphabet "
                f"{self.alphabet!r} (set tokenizer.alphabet)"
            ) from None

    def encode_prompt(self, prompt) -> list[int]:
        return self.encode(prompt.text)  # no chat template: the last user turn via data.template

    def encode_response(self, text: str) -> list[int]:
        return self.encode(text)[1:] + [self.eos_id]

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` up to the first <eos>; other special tokens are dropped."""
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if i >= len(SPECIALS):
                out.append(self.alphabet[i - len(SPECIALS)])
        return "".join(out)


class HFTokenizer:
    """A local `transformers` tokenizer (e.g. Qwen3's), optionally applying its chat template.

    The chat template is the user's data, rendered in transformers' jinja sandbox: whatever a
    render raises (a jinja syntax error, `raise_exception`, an undefined name, the sandbox's
    refusal, a TypeError in an expression) and a render to no tokens are one line naming the
    template's file and the cause (the caller adds the row). `data/chat_template.py` renders the
    first rows on the driver under a time and memory bound.
    """

    def __init__(self, path: str, chat_template: bool = True):
        from transformers import AutoTokenizer  # heavy optional: only a run with an HF tokenizer

        if not Path(path).is_dir():  # else transformers reads it as a hub repo id and says so
            raise FlexFloorError(f"tokenizer.path {path}: no such folder (a local tokenizer directory, "
                                 "e.g. a HuggingFace checkpoint's; nothing is downloaded)")
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise FlexFloorError(f"tokenizer.path {path}: cannot load a tokenizer ({e})") from None
        self.chat_template = chat_template
        self.template_file = template_file(path)
        if chat_template and not self._tok.chat_template:
            raise FlexFloorError(f"tokenizer.path {path}: has no chat template (none in {self.template_file}); "
                                 "set tokenizer.chat_template: false to encode prompts as plain text")
        self.vocab_size = len(self._tok)
        self.eos_id = self._tok.eos_token_id
        self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
        self.bos_id = self._tok.bos_token_id

    def encode(self, text: str) -> list[int]:
        if self.chat_template:
            return self._chat([{"role": "user", "content": text}])
        return self._tok.encode(text)

    def encode_prompt(self, prompt) -> list[int]:
        """A verl row's messages (system turns included) through the chat template, as verl does."""
        if self.chat_template:
            return self._chat(chat_of(prompt))
        return self.encode(prompt.text)

    def render_prompt(self, prompt) -> str:
        """The chat template's text of a prompt, untokenized (what the driver's check measures)."""
        return self._template(chat_of(prompt), tokenize=False)

    def _chat(self, messages: list[dict]) -> list[int]:
        ids = list(self._template(messages, tokenize=True))
        if not ids:
            raise FlexFloorError(f"{self.template_file}: the chat template rendered an empty prompt")
        return ids

    def _template(self, messages: list[dict], tokenize: bool):
        try:
            # transformers 5 returns a BatchEncoding unless asked for the bare ids.
            return self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize,
                                                 return_dict=False)
        except Exception as e:  # the template's own failure, whatever it raised  # noqa: BLE001
            raise FlexFloorError(f"{self.template_file}: chat template: {failure(e)}") from None

    def encode_response(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False) + [self.eos_id]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def chat_of(prompt) -> list[dict]:
    """The messages a chat template renders for a dataset `Prompt`: a verl row's own, else its text
    as one user turn."""
    return list(prompt.messages) if prompt.messages is not None else [{"role": "user", "content": prompt.text}]


def template_file(path: str) -> Path:
    """The file of a tokenizer folder that holds its chat template (what messages name)."""
    folder = Path(path)
    return next((folder / n for n in ("chat_template.jinja", "chat_template.json") if (folder / n).is_file()),
                folder / "tokenizer_config.json")


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    if cfg.kind == "char":
        return CharTokenizer(cfg.alphabet)
    return HFTokenizer(cfg.path, cfg.chat_template)
