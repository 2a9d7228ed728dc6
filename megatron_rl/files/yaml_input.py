"""YAML as a config language, read safely: every config file and `key=value` override goes through here.

`yaml.safe_load` runs no code, but it still lets a file say things a config never means:
  - a key given twice in one mapping (at any depth) silently keeps the last; here it is one error
    naming both lines (`cfg.yaml:12: duplicate key 'optim' (first at line 3)`);
  - aliases (`*a`) expand anchors by reference, so 300 bytes of nested anchors become gigabytes when
    anything walks them; a config has no use for them, so an alias is refused when the parser meets
    it, before anything is built;
  - YAML 1.1 reads `1e-3` as a string (its floats need a dot); here it is the number YAML 1.2 reads.
"""
from __future__ import annotations

import re

import yaml

from elastic.errors import shorten
from megatron_rl.errors import ConfigError


class _Refused(yaml.YAMLError):
    def __init__(self, mark, problem: str):
        super().__init__(problem)
        self.problem_mark, self.problem = mark, problem


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader without aliases or duplicate keys, with YAML 1.2 floats."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(event.start_mark, f"alias *{shorten(event.anchor, 40)}: a config may not use "
                                             "aliases (&anchor / *alias); write the value out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        first: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise _Refused(key_node.start_mark,
                               f"a mapping key: expected a plain value, got a {type(key).__name__}") from None
            if key in first:
                raise _Refused(key_node.start_mark,
                               f"duplicate key {shorten(repr(key), 60)} (first at line {first[key] + 1}); "
                               "the second would silently replace the first")
            first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


# YAML 1.2 core schema floats: `1e-3`, `5E+2` (no dot needed), besides what 1.1 already reads.
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def parse(text: str, where: str, value: bool = False):
    """The YAML document `text`; `where` (a file name, or an override when `value`) prefixes the
    one-line error."""
    try:
        return yaml.load(text, Loader=ConfigLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None and not value else where
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{at}: {'the value is ' if value else ''}not valid YAML ({shorten(problem, 300)})") from None
    except RecursionError:
        raise ConfigError(f"{where}: not valid YAML (nested too deeply)") from None
