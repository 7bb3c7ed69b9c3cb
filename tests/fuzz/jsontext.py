"""JSON documents with hand-made text in them: values that `json.dumps` cannot write (Infinity,
1e999, duplicate keys, deep nesting) are `Raw` strings written verbatim."""

from __future__ import annotations

import copy
import json
from typing import Any

Path = tuple[str | int, ...]


class Raw(str):
    """A value written into the document as this text, not as a JSON string."""


def dumps(obj: Any, indent: int | None = 1) -> str:
    """`json.dumps`, with every `Raw` value replaced by its text."""
    raws: list[str] = []

    def mark(x):
        if isinstance(x, Raw):
            raws.append(str(x))
            return f"@@RAW{len(raws) - 1}@@"
        if isinstance(x, dict):
            return {k: mark(v) for k, v in x.items()}
        if isinstance(x, list):
            return [mark(v) for v in x]
        return x

    text = json.dumps(mark(obj), indent=indent)
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@RAW{i}@@"', raw, 1)
    return text


def label(path: Path) -> str:
    """The JSON path as the loaders name it: `layers[1].sub_batches`, `mesh.data`."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def get(doc: Any, path: Path) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def replaced(doc: Any, path: Path, value: Any) -> Any:
    """A deep copy of `doc` with the value at `path` replaced."""
    out = copy.deepcopy(doc)
    get(out, path[:-1])[path[-1]] = value
    return out


def removed(doc: Any, path: Path) -> Any:
    out = copy.deepcopy(doc)
    del get(out, path[:-1])[path[-1]]
    return out


def with_duplicate(doc: Any, path: Path, key: str, value: Any) -> Any:
    """`doc` with the object at `path` holding `key` twice (the second time with `value`)."""
    obj = get(doc, path) if path else doc
    items = [f"{json.dumps(k)}: {dumps(v, None)}" for k, v in obj.items()]
    items.append(f"{json.dumps(key)}: {dumps(value, None)}")
    text = Raw("{" + ", ".join(items) + "}")
    return text if not path else replaced(doc, path, text)


def nested(depth: int, kind: str = "list") -> Raw:
    if kind == "list":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a": ' * depth + "1" + "}" * depth)


def numeric_paths(doc: Any, path: Path = ()) -> list[Path]:
    """Every path to a number (not a bool) in `doc`."""
    if isinstance(doc, dict):
        return [q for k, v in doc.items() for q in numeric_paths(v, (*path, k))]
    if isinstance(doc, list):
        return [q for i, v in enumerate(doc) for q in numeric_paths(v, (*path, i))]
    return [path] if isinstance(doc, int | float) and not isinstance(doc, bool) else []
