"""Run configs read strictly: one YAML loader for every config file and value the run's parser reads.

PyYAML (and jsonargparse on it) takes a duplicate key silently (the last one wins: a second ``trainer:`` drops the
whole first), expands aliases without bound (a "billion laughs" file hangs the parser), and reports a syntax error
or an unknown tag as a traceback about ``<unicode string>``. Here each of these is one :class:`ConfigFileError`
naming the file and line:

* a syntax error, an unknown tag (``!!python/object``), more than one document: ``FILE:LINE:COLUMN: …``;
* a key written twice in one mapping, at any depth: ``FILE:LINE: duplicate key 'lr' (model.optimization.lr; first at
  line N)`` (a merge key ``<<: *base`` is not a duplicate: the keys written next to it override it, as YAML says);
* aliases that would add more than :data:`MAX_ALIAS_NODES` values, or an alias inside its own anchor: refused before
  anything is expanded;
* a config file that is empty (or only comments), or whose top level is not a mapping.

The loader keeps jsonargparse's own value rules (its implicit resolvers: no timestamps, its float syntax), so a value
means what it meant before. :data:`PARSER_MODE` is the jsonargparse parser mode that uses it (``RunParser`` sets it).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import set_loader
from jsonargparse._loaders_dumpers import get_yaml_default_loader  # jsonargparse's value rules, kept as they are

PARSER_MODE = "lightning_eagle_strict_yaml"
MAX_ALIAS_NODES = 10_000  # values aliases may add beyond the ones written out (a real config's merges add dozens)
_MERGE_TAG = "tag:yaml.org,2002:merge"
_CACHE_SIZE = 32


class ConfigFileError(ValueError, yaml.YAMLError):
    """A config (file or value) that is not strict YAML; the message names the file (or ``the command line``) and line.
    Exits with status 2, like jsonargparse's own config errors."""

    exit_status = 2


class _StrictLoader(get_yaml_default_loader()):
    """jsonargparse's YAML loader (safe: only plain tags); composition and construction are checked here."""


def _where(source: str, mark) -> str:
    return f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source


def _yaml_error(source: str, err: yaml.YAMLError) -> ConfigFileError:
    if isinstance(err, yaml.constructor.ConstructorError) and "could not determine a constructor" in str(err.problem):
        tag = str(err.problem).split("tag ", 1)[-1].replace("tag:yaml.org,2002:", "!!")
        return ConfigFileError(
            f"{_where(source, err.problem_mark)}: unknown YAML tag {tag}: a run config holds plain values (mappings, "
            "lists, strings, numbers, booleans, null)"
        )
    if isinstance(err, yaml.composer.ComposerError) and err.context == "expected a single document in the stream":
        return ConfigFileError(
            f"{_where(source, err.problem_mark)}: a second YAML document (after ---): a run config is one mapping"
        )
    if isinstance(err, yaml.MarkedYAMLError):
        context = f" ({err.context} at line {err.context_mark.line + 1})" if err.context and err.context_mark else ""
        problem = " ".join(str(err.problem or err.context or "invalid YAML").split())
        return ConfigFileError(f"{_where(source, err.problem_mark)}: invalid YAML: {problem}{context}")
    return ConfigFileError(f"{source}: invalid YAML: {' '.join(str(err).split())}")


def _children(node: yaml.Node, where: str, source: str) -> list[tuple[yaml.Node, str]]:
    """The node's children with their dotted place; a mapping's keys are checked for duplicates here."""
    if isinstance(node, yaml.SequenceNode):
        return [(child, f"{where}[{i}]") for i, child in enumerate(node.value)]
    if not isinstance(node, yaml.MappingNode):
        return []
    out, first = [], {}
    for key, value in node.value:
        if key.tag == _MERGE_TAG:
            out += [(key, where), (value, where)]
            continue
        name = key.value if isinstance(key, yaml.ScalarNode) else None
        place = f"{where}.{name}" if where and name is not None else (name or where)
        if name is not None and (key.tag, name) in first:
            raise ConfigFileError(
                f"{source}:{key.start_mark.line + 1}: duplicate key {name!r} ({place}; first at line "
                f"{first[key.tag, name]}): YAML would keep only the last one, silently; write the key once"
            )
        if name is not None:
            first[key.tag, name] = key.start_mark.line + 1
        out += [(key, place), (value, place)]
    return out


def _check_nodes(root: yaml.Node, source: str) -> None:
    """Duplicate keys at any depth, recursive aliases and the values aliases add, without expanding anything."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, str, bool]] = [(root, "", False)]
    while stack:
        node, where, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child, _ in _children(node, where, source))
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise ConfigFileError(
                f"{source}:{node.start_mark.line + 1}: an alias refers to the anchored value that contains it "
                f"({where or 'the top level'}): a recursive structure is not a config"
            )
        on_path.add(key)
        stack.append((node, where, True))
        stack += [(child, place, False) for child, place in _children(node, where, source) if id(child) not in sizes]
    added = sizes[id(root)] - len(sizes)
    if added > MAX_ALIAS_NODES:
        raise ConfigFileError(
            f"{source}: its YAML aliases (*name) would add {added} values, more than {MAX_ALIAS_NODES} (an alias "
            "bomb?): refused before expanding them; write the values out"
        )


_parsed: dict[str, Any] = {}  # text -> value: a file read by our checks and by jsonargparse is parsed once


def strict_load(text: str, source: str) -> Any:
    """The YAML ``text`` (``source``: its file, for messages) as jsonargparse's loader reads it, or
    :class:`ConfigFileError`. ``None`` for an empty document. A text already read is not parsed again."""
    if text in _parsed:
        return copy.deepcopy(_parsed[text])
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, source)
        value = loader.construct_document(node)
    except ConfigFileError:
        raise
    except yaml.YAMLError as err:
        raise _yaml_error(source, err) from None
    finally:
        loader.dispose()
    if len(_parsed) >= _CACHE_SIZE:
        _parsed.pop(next(iter(_parsed)))
    _parsed[text] = value
    return copy.deepcopy(value)


def read_config_file(path: str | os.PathLike) -> dict:
    """A run config file, read strictly: a mapping, or :class:`ConfigFileError` naming the file (empty, not a mapping,
    or not strict YAML)."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as err:
        raise ConfigFileError(f"{source}: not a text file ({err.reason} at byte {err.start})") from None
    value = strict_load(text, source)
    if value is None:
        raise ConfigFileError(
            f"{source}: the config file is empty (expected a mapping of sections: trainer:, model:, data:)"
        )
    if not isinstance(value, dict):
        raise ConfigFileError(
            f"{source}: expected a mapping of sections (trainer:, model:, data:), got {type(value).__name__} "
            f"{str(value)[:60]!r}"
        )
    return value


def _current_source(path: str = "") -> str:
    """The file jsonargparse is reading now (its stack of config files), else ``path``, else the command line."""
    from jsonargparse import _util

    stack = getattr(_util, "config_load_stack", None)
    loading = stack.get() if stack is not None else ()
    if loading:
        return str(loading[-1][1])
    return str(path) if path else "the command line"


def jsonargparse_load(value: str, path: str = "") -> Any:
    """jsonargparse's ``yaml`` loader, strict (registered as :data:`PARSER_MODE`)."""
    loaded = strict_load(value, _current_source(path))
    # as jsonargparse's yaml_load: "key:" alone (or "{a, b}") is a string, not a mapping of nulls
    if isinstance(loaded, dict) and loaded and all(v is None for v in loaded.values()):
        if len(loaded) == 1 and value.strip() == f"{next(iter(loaded))}:":
            return value
        keys = set(value.strip(" {}").replace(" ", "").split(","))
        if keys and keys == set(loaded):
            return value
    return loaded


set_loader(PARSER_MODE, jsonargparse_load, (yaml.YAMLError,))
