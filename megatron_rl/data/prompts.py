"""Prompt datasets: JSONL files and HuggingFace `datasets` files on disk, each row a `Prompt`.

Accepted sources (never a hub download):
  - `*.jsonl`: read here, line by line, so an error names the file and the 1-based line;
  - `*.json`, `*.parquet`, `*.csv`: through `datasets.load_dataset(<format>, data_files=...)`;
  - a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`: `load_from_disk`.

A row is either plain (`prompt` a string, `answer` beside it) or verl-format (`prompt` a list of
chat messages, the answer at `reward_model.ground_truth`, plus `data_source` and `extra_info`;
see `data/chat.py`); `data.format: auto` tells them apart row by row. `data_source` and
`extra_info` travel with each prompt to the reward function.

A row without the prompt field (absent, null or empty) is a `DatasetError` naming file and row, or,
with `on_bad_row: skip`, a counted skip (`PromptDataset.skipped`). The whole file is checked when
it is loaded, before any rollout starts, so a bad row can never stop a run half-way. Prompt ids
must be unique: they key the length history the planner reads and the sampling seeds.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from elastic.errors import shorten
from elastic.trace import iter_jsonl
from megatron_rl.config import require
from megatron_rl.data.chat import VERL_ANSWER, chat_messages, field_at, is_chat, last_user_content
from megatron_rl.errors import ConfigError, FlexFloorError


class DatasetError(FlexFloorError):
    """A prompt dataset that cannot be used; the message names the file and the row."""


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str
    answer: str | None = None
    # The row's other columns, for reward functions that need more than the answer.
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    where: str = field(default="", compare=False, hash=False)  # "file:line" of its row, for errors
    # The row's `data_source` (verl's name of its task; the file's stem when the row has none):
    # routes built-in rewards and groups validation (`val-core/<data_source>/...`).
    data_source: str = field(default="", compare=False, hash=False)
    # verl-format rows: the chat messages an HF tokenizer renders with its chat template.
    messages: tuple[dict[str, str], ...] | None = field(default=None, compare=False, hash=False)

    @property
    def extra_info(self) -> dict[str, Any]:
        """What a verl reward function gets as `extra_info` (the row's, or {})."""
        info = self.extra.get("extra_info")
        return info if isinstance(info, dict) else {}


def check_template(template: str) -> None:
    """`data.template` may name `{prompt}` only: another field, a positional `{0}`, an attribute or
    index (`{prompt.__class__}`) or a stray brace would fail (or leak) at the first row."""
    import string

    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template)
                  if name is not None]
    except ValueError as e:
        raise ConfigError(f"data.template: {e} (write a literal brace as {{{{ or }}}})") from None
    for name, spec, conv in fields:
        require(name == "prompt" and not spec and not conv,
                f"data.template: only {{prompt}} may be filled in, got {{{shorten(name, 40)}"
                f"{'!' + conv if conv else ''}{':' + shorten(spec, 20) if spec else ''}}} (write a literal "
                "brace as {{ or }})")


@dataclass
class DataConfig:
    path: str
    prompt_field: str = "prompt"
    # A field, or a dotted path into nested ones (`reward_model.ground_truth`). None: `answer` for
    # plain rows, `reward_model.ground_truth` for verl-format ones.
    answer_field: str | None = None
    # Rows without this field (dotted paths too) get the id `<file stem>-<row>` (row 0-based).
    id_field: str = "prompt_id"
    # auto: a `prompt` that is a list of chat messages is a verl row, a string a plain one;
    # plain / verl: every row must be of that kind.
    format: Literal["auto", "plain", "verl"] = "auto"
    # `error`: a bad row stops loading with its file and row; `skip`: it is counted and left out.
    on_bad_row: Literal["error", "skip"] = "error"
    # Which split of a `DatasetDict` saved to disk.
    split: str = "train"
    # Python format string applied to the prompt text, e.g. "Question: {prompt}\nAnswer:". For a
    # verl row it fills in the last user message, for tokenizers without a chat template.
    template: str = "{prompt}"

    def __post_init__(self) -> None:
        require(bool(self.path), "data.path: expected a dataset file or directory, got ''")
        require(self.format in ("auto", "plain", "verl"),
                f"data.format: expected auto, plain or verl, got {self.format!r}")
        require("{prompt}" in self.template,
                f"data.template: expected a text containing '{{prompt}}', got {shorten(repr(self.template), 60)}")
        check_template(self.template)


@dataclass
class PromptDataset:
    prompts: list[Prompt]
    source: str
    skipped: int = 0
    # (where, reason) of each skipped row, so the user can find them.
    skipped_rows: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]


def _jsonl_rows(path: Path) -> Iterable[tuple[str, Any]]:
    for where, _, obj in iter_jsonl(path, DatasetError, "dataset"):
        yield where, obj


def _hf_rows(path: Path, split: str) -> Iterable[tuple[str, Any]]:
    import datasets  # heavy: only when an HF file is actually used

    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DatasetError(
                        f"{path}: no split {split!r} (splits: {', '.join(ds)}); set data.split"
                    )
                ds = ds[split]
        else:
            fmt = {".json": "json", ".parquet": "parquet", ".csv": "csv"}[path.suffix]
            ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except DatasetError:
        raise
    except Exception as e:  # datasets raises many types for an unreadable file  # noqa: BLE001
        raise DatasetError(f"{path}: cannot load with `datasets` ({type(e).__name__}: {e})") from None
    for i, row in enumerate(ds):
        yield f"{path} row {i}", row


def _rows(path: Path, split: str) -> Iterable[tuple[str, Any]]:
    if not path.exists():
        raise DatasetError(f"{path}: no such dataset file or directory")
    if path.is_dir() or path.suffix in (".json", ".parquet", ".csv"):
        return _hf_rows(path, split)
    if path.suffix == ".jsonl":
        return _jsonl_rows(path)
    raise DatasetError(
        f"{path}: unknown dataset format {path.suffix!r}; expected .jsonl, .json, .parquet, .csv "
        "or a directory saved with `datasets`"
    )


def _prompt_text(cfg: DataConfig, where: str, value: Any) -> tuple[str, tuple | None]:
    """The prompt's text (through `data.template`) and, for a verl row, its chat messages."""
    chat = is_chat(value)
    if cfg.format == "verl" and not chat:
        raise DatasetError(f"{where}: data.format verl: field {cfg.prompt_field!r}: expected a list of "
                           f"{{role, content}} messages, got {value!r:.80}")
    if chat and cfg.format != "plain":
        try:
            messages = chat_messages(value, where, cfg.prompt_field)
        except ValueError as e:
            raise DatasetError(str(e)) from None
        return cfg.template.format(prompt=last_user_content(messages)), messages
    if not isinstance(value, str):
        raise DatasetError(f"{where}: field {cfg.prompt_field!r}: expected a string or a list of chat "
                           f"messages, got {value!r:.80}")
    return cfg.template.format(prompt=value), None


def _prompt_from_row(cfg: DataConfig, where: str, row: Any, index: int, stem: str) -> Prompt:
    if isinstance(row, DatasetError):
        raise row
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object with a {cfg.prompt_field!r} field")
    value = row.get(cfg.prompt_field)
    if value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0):
        raise DatasetError(
            f"{where}: missing prompt field {cfg.prompt_field!r} (fields: {', '.join(sorted(row))})"
        )
    text, messages = _prompt_text(cfg, where, value)
    answer_field = cfg.answer_field or (VERL_ANSWER if messages is not None else "answer")
    answer = field_at(row, answer_field)
    if messages is not None and (answer is None or str(answer).strip() == ""):
        # A verl row always carries its ground truth: without it every response would score
        # `no_reference` and train on nothing, so the row is refused here, not at the first step.
        raise DatasetError(f"{where}: no answer at {answer_field!r} (set data.answer_field to the "
                           "field that holds it)")
    pid = field_at(row, cfg.id_field)
    pid = f"{stem}-{index:05d}" if pid is None else str(pid)
    source = row.get("data_source")
    extra = {k: v for k, v in row.items()
             if k not in (cfg.prompt_field, answer_field, cfg.id_field, "data_source")}
    return Prompt(
        prompt_id=pid,
        text=text,
        answer=None if answer is None else str(answer),
        extra=extra,
        where=where,
        data_source=str(source) if source not in (None, "") else stem,
        messages=messages,
    )


def load_prompts(cfg: DataConfig) -> PromptDataset:
    """Read and check every row of `cfg.path` (see the module docstring for the rules)."""
    path = Path(cfg.path)
    prompts: list[Prompt] = []
    skipped: list[tuple[str, str]] = []
    first_seen: dict[str, str] = {}
    for index, (where, row) in enumerate(_rows(path, cfg.split)):
        try:
            prompt = _prompt_from_row(cfg, where, row, index, path.stem)
            if prompt.prompt_id in first_seen:
                raise DatasetError(
                    f"{where}: duplicate prompt_id {prompt.prompt_id!r}, "
                    f"first at {first_seen[prompt.prompt_id]}"
                )
        except DatasetError as e:
            if cfg.on_bad_row == "error":
                raise
            skipped.append((where, str(e)))
            continue
        first_seen[prompt.prompt_id] = where
        prompts.append(prompt)
    if not prompts:
        raise DatasetError(f"{path}: no usable prompts ({len(skipped)} rows skipped)")
    return PromptDataset(prompts, str(path), len(skipped), skipped)
