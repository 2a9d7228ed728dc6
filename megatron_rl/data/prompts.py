"""Prompt datasets: JSONL files and HuggingFace `datasets` files on disk, each row a `Prompt`.

Accepted sources (never a hub download):
  - `*.jsonl`: read here, line by line, so an error names the file and the 1-based line;
  - `*.json`, `*.parquet`, `*.csv`: through `datasets.load_dataset(<format>, data_files=...)`;
  - a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`: `load_from_disk`.

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

from elastic.trace import iter_jsonl
from megatron_rl.config import require
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
                f"data.template: only {{prompt}} may be filled in, got {{{name[:40]}"
                f"{'!' + conv if conv else ''}{':' + spec[:20] if spec else ''}}} (write a literal "
                "brace as {{ or }})")


@dataclass
class DataConfig:
    path: str
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    # Rows without this field get the id `<file stem>-<row>` (row 0-based, in file order).
    id_field: str = "prompt_id"
    # `error`: a bad row stops loading with its file and row; `skip`: it is counted and left out.
    on_bad_row: Literal["error", "skip"] = "error"
    # Which split of a `DatasetDict` saved to disk.
    split: str = "train"
    # Python format string applied to the prompt text, e.g. "Question: {prompt}\nAnswer:".
    template: str = "{prompt}"

    def __post_init__(self) -> None:
        require(bool(self.path), "data.path: expected a dataset file or directory, got ''")
        require("{prompt}" in self.template, "data.template: must contain '{prompt}'")
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


def _prompt_from_row(cfg: DataConfig, where: str, row: Any, index: int, stem: str) -> Prompt:
    if isinstance(row, DatasetError):
        raise row
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object with a {cfg.prompt_field!r} field")
    text = row.get(cfg.prompt_field)
    if text is None or text == "":
        raise DatasetError(
            f"{where}: missing prompt field {cfg.prompt_field!r} (fields: {', '.join(sorted(row))})"
        )
    if not isinstance(text, str):
        raise DatasetError(f"{where}: field {cfg.prompt_field!r} must be a string, got {text!r}")
    answer = row.get(cfg.answer_field)
    pid = row.get(cfg.id_field)
    pid = f"{stem}-{index:05d}" if pid is None else str(pid)
    extra = {k: v for k, v in row.items() if k not in (cfg.prompt_field, cfg.answer_field, cfg.id_field)}
    return Prompt(
        prompt_id=pid,
        text=cfg.template.format(prompt=text),
        answer=None if answer is None else str(answer),
        extra=extra,
        where=where,
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
