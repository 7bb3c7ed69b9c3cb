"""Reading and writing the files users name: regular files only (a FIFO, device or directory is
refused by `os.stat` before anything opens it), of bounded size, JSON parsed strictly (no NaN or
Infinity, no duplicate keys, bounded nesting), and output paths checked before any work starts.
Every problem is one UserError line naming the path (and the JSON path inside it) and the fix."""

from __future__ import annotations

import json
import math
import os
import pathlib
import stat

from oases_jax.errors import UserError

MAX_JSON_BYTES = 64 * 2**20  # plans, clusters, profiles and configs are kilobytes
MAX_JSON_DEPTH = 32  # objects and lists within each other; our formats nest 6 deep at most

_KINDS = ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def regular_file(path: str | os.PathLike, what: str, fix: str,
                 max_bytes: int | None = None) -> os.stat_result:
    """The stat of `path`, a regular file of at most `max_bytes` (symlinks followed); a missing
    path, a directory, FIFO, device or socket, or a larger file is a UserError."""
    name = str(path)
    if not name:
        raise UserError(f"{what} is an empty path; {fix}")
    try:
        st = os.stat(name)
    except (FileNotFoundError, NotADirectoryError):
        raise UserError(f"{what} {name!r} does not exist; {fix}") from None
    except OSError as e:
        raise UserError(f"{what} {name!r} cannot be read ({e.strerror}); {fix}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{what} {name!r} is {_kind(st.st_mode)}, not a regular file; {fix}")
    if max_bytes is not None and st.st_size > max_bytes:
        raise UserError(f"{what} {name!r} is {st.st_size:,} bytes, more than the "
                        f"{max_bytes:,} such a file can be; {fix}")
    return st


def read_bytes(path: str | os.PathLike, what: str, fix: str,
               max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a regular file (`regular_file`). Opened non-blocking and checked again, so
    that a FIFO put in its place after the check cannot hang the read."""
    regular_file(path, what, fix, max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise UserError(f"{what} {str(path)!r} cannot be read ({e.strerror}); {fix}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"{what} {str(path)!r} changed into {_kind(os.fstat(fd).st_mode)} "
                            f"while being read; {fix}")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UserError(f"{what} {str(path)!r} grew past {max_bytes:,} bytes; {fix}")
    return data


def read_json(path: str | os.PathLike, what: str, fix: str,
              max_bytes: int = MAX_JSON_BYTES) -> object:
    """A JSON file, read and parsed strictly (`loads`)."""
    data = read_bytes(path, what, fix, max_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {str(path)!r} is not UTF-8 text (byte {e.start}); {fix}") from None
    return loads(text, f"{what} {str(path)!r}", fix)


class _NonFinite(str):
    """A number JSON's grammar does not allow, or one too large for a float (its text)."""


class _Duplicated(dict):
    duplicates: list[str]


def _pairs(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) < len(pairs):  # marked here, reported with its path by `_check_tree`
        seen: set[str] = set()
        marked = _Duplicated(out)
        marked.duplicates = [k for k, _ in pairs if k in seen or seen.add(k)]
        return marked
    return out


def _float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def path_label(path: tuple) -> str:
    """A JSON path as the messages name it: `layers[1].sub_batches`, `mesh.data`."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "the top level"


def loads(text: str, where: str, fix: str) -> object:
    """Parse JSON text strictly: NaN, Infinity and numbers beyond a float's range, a key twice
    in one object, and nesting deeper than MAX_JSON_DEPTH are UserErrors naming the JSON path."""
    try:
        doc = json.loads(text, parse_constant=_NonFinite, parse_float=_float,
                         object_pairs_hook=_pairs)
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not valid JSON ({e.msg}: line {e.lineno} column "
                        f"{e.colno}); {fix}") from None
    except RecursionError:
        raise UserError(f"{where} nests lists or objects more than {MAX_JSON_DEPTH} deep; "
                        f"{fix}") from None
    except ValueError:  # an integer of more digits than Python converts (4300)
        raise UserError(f"{where} holds an integer of thousands of digits; {fix}") from None
    _check_tree(doc, where, fix)
    return doc


def _check_tree(doc: object, where: str, fix: str) -> None:
    """Walk the parsed document (iteratively: it may be deep) for what `loads` refuses."""
    stack: list[tuple[tuple, object]] = [((), doc)]
    while stack:
        path, value = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise UserError(f"{where}: {path_label(path[:MAX_JSON_DEPTH])} nests lists or "
                            f"objects more than {MAX_JSON_DEPTH} deep; {fix}")
        if isinstance(value, _NonFinite):
            raise UserError(f"{where}: {path_label(path)} = {value}: JSON numbers must be "
                            f"finite (no NaN, Infinity or overflow); {fix}")
        if isinstance(value, _Duplicated):
            key = value.duplicates[0]
            raise UserError(f"{where}: {path_label((*path, key))} is given twice; keep one; "
                            f"{fix}")
        if isinstance(value, dict):
            stack.extend(((*path, k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(value))))


def output_file(path: str | os.PathLike, flag: str) -> pathlib.Path:
    """A file we are about to write: not a directory or special file, under directories (existing
    or creatable) we may write to. Checked before the work whose result it holds."""
    p = _output(path, flag)
    if p.exists() and not p.is_file():
        raise UserError(f"{flag} {str(p)!r} is {_kind(p.stat().st_mode)}; name a file, e.g. "
                        f"{str(p / 'out.json')!r}")
    return p


def output_dir(path: str | os.PathLike, flag: str) -> pathlib.Path:
    """A directory we are about to fill: a directory if it exists, creatable otherwise."""
    p = _output(path, flag)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {str(p)!r} is {_kind(p.stat().st_mode)}, not a directory; "
                        "name a directory")
    return p


def _output(path: str | os.PathLike, flag: str) -> pathlib.Path:
    if not str(path):
        raise UserError(f"{flag} is an empty path; name a path")
    p = pathlib.Path(path)
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{flag} {str(p)!r} is under {str(parent)!r}, which is "
                                f"{_kind(parent.stat().st_mode)}, not a directory; choose "
                                "another path")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UserError(f"{flag} {str(p)!r}: cannot write under {str(parent)!r}; "
                                "choose a writable path")
            break
    return p
