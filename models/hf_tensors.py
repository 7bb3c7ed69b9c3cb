"""The tensors of a Hugging Face safetensors checkpoint, checked from their headers: a tensor's
dtype and shape are verified before its bytes are read, and every tensor must be used."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from oases_jax.errors import UserError
from oases_jax.files import loads, read_json, regular_file

# Header dtypes of floating-point weights; anything else (integers, bool, fp8) is not a weight
# we can convert exactly.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _corrupt(file: Path, e: Exception) -> UserError:
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    return UserError(f"safetensors file {file} is corrupt or truncated ({reason[:160]}); "
                     "re-download it")


def _regular(file: Path) -> Path:
    regular_file(file, "safetensors file", "pass the checkpoint's files themselves")
    return file


def _check_header_names(file: Path) -> None:
    """A header of strict JSON: each tensor name once (safetensors' own parser keeps the last
    of two), no NaN, bounded nesting."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > min(os.fstat(f.fileno()).st_size, 100 << 20):
            raise _corrupt(file, ValueError(f"header length {length} is beyond the file"))
        text = f.read(length)
    try:
        loads(text.decode(), f"safetensors header of {file}", "re-download it")
    except UnicodeDecodeError as e:
        raise _corrupt(file, e) from None
    except UserError as e:
        raise UserError(f"safetensors file {file} is corrupt or truncated ({e})") from None


def _index_files(path: Path, index: Path) -> tuple[list[Path], dict[str, str]]:
    """The shard files of a sharded checkpoint and its weight map (tensor -> file name)."""
    data = read_json(index, "safetensors index", "re-download it")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(v, str) for v in weight_map.values())):
        raise UserError(f"{index} has no weight_map of tensor names to file names; re-download "
                        "it")
    for name in weight_map.values():
        if Path(name).name != name or name in (".", ".."):
            raise UserError(f"{index} names shard {name!r}, which is not a file name in "
                            f"{path}; re-download the index")
    files = [path / name for name in sorted(set(weight_map.values()))]
    for f in files:
        if not f.exists():
            raise UserError(f"{index} lists shard {f.name}, which is missing; fetch every shard")
    return files, weight_map


class Checkpoint:
    """A checkpoint's tensors by name. Files are memory-mapped: `read` reads one tensor, after
    `check` has verified its header; `unused` lists those never checked."""

    def __init__(self, path: Path, prefixes: tuple[str, ...]):
        self.path, self.prefixes = path, prefixes
        self.where: dict[str, tuple[Path, object]] = {}
        self.used: set[str] = set()
        index = path / "model.safetensors.index.json"
        weight_map = None
        if index.exists():
            files, weight_map = _index_files(path, index)
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise UserError(f"no *.safetensors files in {path}; save the checkpoint with "
                                "save_pretrained(safe_serialization=True)")
        for file in files:
            self._open(_regular(file), weight_map)
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self.where))
            if absent:
                raise UserError(f"{index} maps tensor {absent[0]!r} to {weight_map[absent[0]]}, "
                                "which does not hold it; re-download the checkpoint")

    def _open(self, file: Path, weight_map: dict[str, str] | None) -> None:
        _check_header_names(file)
        try:
            handle = safe_open(file, framework="np")
            keys = list(handle.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise _corrupt(file, e) from None
        for key in keys:
            if key in self.where:
                raise UserError(f"tensor {key!r} is in both {self.where[key][0].name} and "
                                f"{file.name}; the checkpoint is inconsistent")
            if weight_map is not None and weight_map.get(key) != file.name:
                raise UserError(f"tensor {key!r} is in {file.name} but the index maps it to "
                                f"{weight_map.get(key)!r}; re-download the checkpoint")
            self.where[key] = (file, handle)

    def name(self, key: str) -> str | None:
        """The stored name of `key` (with whichever accepted prefix it carries), or None."""
        return next((p + key for p in self.prefixes if p + key in self.where), None)

    def check(self, key: str, shape: tuple[int, ...]) -> str:
        """Verify `key`'s header (present, a float dtype, `shape`) without reading its bytes;
        returns its stored name and counts it as used."""
        name = self.name(key)
        if name is None:
            raise UserError(f"tensor {key!r} is missing from the safetensors files in "
                            f"{self.path}; the checkpoint does not match its config.json")
        file, handle = self.where[name]
        try:
            header = handle.get_slice(name)
            dtype, stored = header.get_dtype(), tuple(header.get_shape())
        except SafetensorError as e:
            raise _corrupt(file, e) from None
        if dtype not in FLOAT_DTYPES:
            raise UserError(f"tensor {name!r} in {file} is stored as {dtype}; a weight is one of "
                            f"{', '.join(FLOAT_DTYPES)}: the file is damaged or not this model's")
        if stored != tuple(shape):
            raise UserError(f"tensor {name!r} in {file} has shape {stored} but config.json "
                            f"implies {tuple(shape)}; use the config.json that matches the "
                            "checkpoint")
        self.used.add(name)
        return name

    def read(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        """`key` as float32 (parameters are float32 whatever the checkpoint stores)."""
        name = self.check(key, shape)
        return self.read_raw(name).astype(np.float32)

    def read_raw(self, name: str) -> np.ndarray:
        """Stored tensor `name` as it is (for buffers whose dtype varies)."""
        file, handle = self.where[name]
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise _corrupt(file, e) from None

    def unused(self) -> list[str]:
        return sorted(set(self.where) - self.used)
