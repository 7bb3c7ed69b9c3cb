"""What a checkpoint's bytes must be: a digest of every array and of the metadata, written with
each save and checked before a restored byte is used, and a scan for files orbax cannot read.

Orbax and TensorStore check only the layout around the data (zarr3 checksums a shard's index,
OCDBT its manifest), not the array bytes: a flipped bit inside an array file restores as a
different weight without a word. So each save records, in its metadata, a 64-bit digest of each
array's values in the standard layout, computed on the devices where the arrays live (an exact
integer sum of position-mixed words, so independent of sharding, process count and reduction
order); a restore recomputes it on what it read and compares. The metadata carries a digest of
its own, and the step directory is scanned before orbax opens anything, so a FIFO or a device
where a file belongs (a read that would hang) is refused rather than read.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import stat
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

META_DIGEST = "digest"  # the metadata's own digest, a key of the metadata JSON
ARRAY_DIGESTS = "array_digests"  # [[keystr(path), 16 hex digits], ...]


class CheckpointDamaged(Exception):
    """A checkpoint step whose files or values are not what was saved; `reason` says where."""

    def __init__(self, step: int, reason: str):
        super().__init__(reason)
        self.step, self.reason = step, reason


def _mix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: every input bit reaches every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (narrow types widened, 8-byte types split in two)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = x.dtype.itemsize
    if width >= 4:  # an 8-byte type gains a trailing axis of 2 words
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[width]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _digest(x: jax.Array) -> jax.Array:
    """Two uint32 lanes: sums (mod 2^32) of each word mixed with its flat position. A sum of
    integers is exact in any order, so the digest is the same however the array is sharded."""
    words = _words(x)
    index = jnp.arange(words.size, dtype=jnp.uint32).reshape(words.shape)
    h = _mix(words ^ _mix(index + jnp.uint32(0x9E3779B9)))
    return jnp.stack([jnp.sum(h, dtype=jnp.uint32),
                      jnp.sum(_mix(h + jnp.uint32(0x632BE5AB)), dtype=jnp.uint32)])


_digests = jax.jit(lambda leaves: [_digest(x) for x in leaves])


def array_digests(tree: Any) -> list[list[str]]:
    """[keystr(path), 16 hex digits] for every array leaf of `tree`, in its flattening order (a
    global computation on the arrays' own devices: every process of a multi-process run calls
    it and gets the same)."""
    named = [(jax.tree_util.keystr(path), leaf)
             for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
             if isinstance(leaf, jax.Array | np.ndarray)]
    lanes = _digests([leaf for _, leaf in named])
    return [[name, "".join(f"{int(v):08x}" for v in np.asarray(d.addressable_data(0)))]
            for (name, _), d in zip(named, lanes, strict=True)]


def mismatch(saved: list[list[str]], restored: list[list[str]]) -> str | None:
    """The first array whose restored digest is not its saved one, in words (by position: the
    restored tree is the saved one's structure); None if all match."""
    if len(saved) != len(restored):
        return f"{len(restored)} arrays were restored where {len(saved)} were saved"
    for (name, want), (_, got) in zip(saved, restored, strict=True):
        if want != got:
            return f"array {name} does not match its saved digest"
    return None


def sealed(meta: dict) -> dict:
    """`meta` with its own digest added (over its canonical JSON)."""
    return {**meta, META_DIGEST: _json_digest(meta)}


def unsealed(meta: dict) -> tuple[dict, str | None]:
    """(`meta` without its digest, a reason it is damaged or None). Metadata written before
    digests existed has none and is taken as it is."""
    meta = dict(meta)
    digest = meta.pop(META_DIGEST, None)
    if digest is not None and digest != _json_digest(meta):
        return meta, "its metadata does not match its digest"
    return meta, None


def _json_digest(meta: dict) -> str:
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def unreadable_entry(step_dir: pathlib.Path) -> str | None:
    """The first entry under `step_dir` that is neither a directory nor a regular file (a FIFO,
    a device, a socket, a symbolic link; orbax writes none), in words; None if there is none.
    Checked with lstat before anything is opened, so a FIFO cannot make the restore hang."""
    kinds = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
             stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket",
             stat.S_IFLNK: "a symbolic link"}
    for root, dirs, files in os.walk(step_dir):
        for name in sorted(dirs + files):
            path = pathlib.Path(root) / name
            mode = os.lstat(path).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                kind = kinds.get(stat.S_IFMT(mode), "not a regular file")
                return f"{path.relative_to(step_dir.parent)} is {kind}, not a regular file"
    return None
