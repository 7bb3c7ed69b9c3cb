"""Token corpora and deterministic, resumable, process-sharded batches.

A batch is a pure function of (seed, step): resuming at step k needs no loader state, and every
process agrees on the global batch while materialising only the rows of its own devices.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sysconfig

import jax
import numpy as np
from jax.sharding import NamedSharding

from oases_jax.errors import UserError
from oases_jax.files import regular_file

BYTE_VOCAB = 256
VAL_EVERY = 20  # stdlib / directory corpora: every 20th file is held out for validation
VAL_FRACTION = 0.1  # single-file corpora: the last 10% of tokens is held out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Corpus:
    name: str
    train: np.ndarray  # 1-D token ids
    val: np.ndarray
    vocab_size: int  # ids are < vocab_size

    def describe(self) -> str:
        return f"{self.name}: {len(self.train):,} train / {len(self.val):,} val tokens"


def _bytes_of(files: list[pathlib.Path]) -> np.ndarray:
    return np.frombuffer(b"".join(p.read_bytes() for p in files), dtype=np.uint8)


def _split_files(name: str, files: list[pathlib.Path]) -> Corpus:
    if len(files) < 2:
        return _split_tail(name, _bytes_of(files), BYTE_VOCAB)
    val = [f for i, f in enumerate(files) if i % VAL_EVERY == VAL_EVERY - 1] or files[-1:]
    train = [f for f in files if f not in set(val)]
    return Corpus(name=name, train=_bytes_of(train), val=_bytes_of(val), vocab_size=BYTE_VOCAB)


def _split_tail(name: str, tokens: np.ndarray, vocab: int) -> Corpus:
    cut = int(len(tokens) * (1 - VAL_FRACTION))
    return Corpus(name=name, train=tokens[:cut], val=tokens[cut:], vocab_size=vocab)


DATA_FIX = ("pass --data stdlib, a text file, a directory of *.txt files, a nanoGPT .bin, or a "
            "directory holding train.bin and val.bin")


def _file(path: pathlib.Path, what: str = "data file") -> pathlib.Path:
    """A regular, non-empty file (never a FIFO or device: they would hang or never end)."""
    if regular_file(path, what, DATA_FIX).st_size == 0:
        raise UserError(f"{what} {str(path)!r} is empty; {DATA_FIX}")
    return path


def _bin(path: pathlib.Path) -> np.ndarray:
    size = _file(path, "token file").stat().st_size
    if size % 2:
        raise UserError(f"token file {path} has an odd size ({size} bytes); .bin files hold uint16")
    return np.memmap(path, dtype=np.uint16, mode="r")


def stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.parts),
        key=lambda p: p.relative_to(root).as_posix(),
    )


def load_corpus(spec: str, vocab_size: int | None = None) -> Corpus:
    """`stdlib` (default): this Python's standard-library sources, bytes as tokens.
    A `.bin` file: nanoGPT uint16 tokens (last 10% validation); a directory holding `train.bin`
    and `val.bin`: nanoGPT's split. Any other file: its bytes; a directory: its `*.txt` files.
    With `vocab_size`, token ids must fit a model of that vocabulary."""
    corpus = _load(spec)
    if vocab_size is not None and corpus.vocab_size > vocab_size:
        raise UserError(
            f"data {spec!r} has token ids up to {corpus.vocab_size - 1} but the model's "
            f"vocab_size is {vocab_size}; pass --model-set vocab_size={corpus.vocab_size}"
        )
    return corpus


def data_files(spec: str) -> tuple[str, list[pathlib.Path]]:
    """What `--data SPEC` names, checked without reading it: ("stdlib", []), ("split", [train.bin,
    val.bin]), ("bin", [file]), ("text", [file]) or ("dir", [*.txt files]). Paths that do not
    exist, are empty, or are FIFOs, devices or sockets are a UserError naming the path."""
    if spec == "stdlib":
        return "stdlib", []
    if not spec:
        raise UserError(f"--data is an empty path; {DATA_FIX}")
    path = pathlib.Path(spec)
    if not os.path.isdir(path):
        return ("bin" if path.suffix == ".bin" else "text"), [_file(path)]
    if os.path.lexists(path / "train.bin"):
        if not os.path.lexists(path / "val.bin"):
            raise UserError(f"{path} has train.bin but no val.bin; add it or pass train.bin alone")
        return "split", [_file(path / "train.bin", "token file"),
                         _file(path / "val.bin", "token file")]
    files = [f for f in sorted(path.rglob("*.txt")) if not f.is_dir()]
    for f in files:
        regular_file(f, "data file", DATA_FIX)
    if not files:
        raise UserError(f"data directory {spec!r} has no *.txt files and no train.bin")
    if not sum(f.stat().st_size for f in files):
        raise UserError(f"data directory {spec!r} holds only empty *.txt files; {DATA_FIX}")
    return "dir", files


def _load(spec: str) -> Corpus:
    kind, files = data_files(spec)
    name = str(pathlib.Path(spec)) if spec else spec
    if kind == "stdlib":
        return _split_files("stdlib", stdlib_files())
    if kind == "split":
        train, val = _bin(files[0]), _bin(files[1])
        return Corpus(name=name, train=train, val=val, vocab_size=_vocab(train, val))
    if kind == "dir":
        return _split_files(name, files)
    if kind == "bin":
        tokens = _bin(files[0])
        return _split_tail(name, tokens, _vocab(tokens))
    return _split_tail(name, _bytes_of(files), BYTE_VOCAB)


def _vocab(*token_arrays: np.ndarray) -> int:
    return int(max(int(t.max()) for t in token_arrays if len(t))) + 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchSampler:
    """Random windows of `seq_len + 1` tokens; batch `step` depends only on (seed, step)."""

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    seed: int
    stream: int = 0  # 0: training, 1: validation (independent random streams)

    def __post_init__(self):
        if len(self.tokens) <= self.seq_len + 1:
            raise UserError(
                f"corpus split has {len(self.tokens)} tokens, fewer than seq_len+1="
                f"{self.seq_len + 1}; use a shorter --seq-len or more data"
            )

    def offsets(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.stream, step])
        return rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)

    def rows(self, offsets: np.ndarray) -> np.ndarray:
        return np.stack([self.tokens[o : o + self.seq_len + 1] for o in offsets]).astype(np.int32)

    def host_batch(self, step: int) -> np.ndarray:
        """The whole global batch on the host: [batch, seq_len + 1] int32."""
        return self.rows(self.offsets(step))

    def device_batch(self, step: int, sharding: NamedSharding, microbatches: int = 1) -> jax.Array:
        """The global batch as a sharded array of shape [microbatches, batch/microbatches, L+1].

        Each process reads only the rows that land on its own devices.
        """
        offsets = self.offsets(step).reshape(microbatches, -1)
        shape = (*offsets.shape, self.seq_len + 1)

        def fetch(index):
            return self.rows(offsets[index[:2]].reshape(-1)).reshape(*offsets[index[:2]].shape, -1)[
                ..., index[2]
            ]

        return jax.make_array_from_callback(shape, sharding, fetch)
