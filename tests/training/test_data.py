"""Corpora and batches: the stdlib default, text and nanoGPT .bin files, determinism, sharding."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from oases_jax.errors import UserError
from oases_jax.mesh import make_mesh
from oases_jax.training.data import BatchSampler, load_corpus, stdlib_files


def test_stdlib_corpus_is_real_python_and_split_by_file():
    corpus = load_corpus("stdlib")
    assert corpus.vocab_size == 256
    assert len(corpus.train) > 10_000_000 and len(corpus.val) > 100_000
    text = bytes(corpus.train[:200_000]).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    files = stdlib_files()
    first_val_file = files[19].read_bytes()  # every 20th file is held out
    assert bytes(corpus.val[: len(first_val_file)]) == first_val_file
    assert len(corpus.train) + len(corpus.val) == sum(f.stat().st_size for f in files)


def test_text_file_and_directory(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello world " * 100)
    corpus = load_corpus(str(tmp_path / "a.txt"))
    assert len(corpus.train) == 1080 and len(corpus.val) == 120
    assert bytes(corpus.train[:5]) == b"hello"
    assert load_corpus(str(tmp_path)).vocab_size == 256


def test_nanogpt_bin_files(tmp_path):
    train = np.arange(1000, dtype=np.uint16) % 700
    val = np.arange(300, dtype=np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    corpus = load_corpus(str(tmp_path))
    np.testing.assert_array_equal(corpus.train, train)
    np.testing.assert_array_equal(corpus.val, val)
    assert corpus.vocab_size == 700
    single = load_corpus(str(tmp_path / "train.bin"))
    assert len(single.train) == 900 and len(single.val) == 100


def test_bad_data_paths(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(UserError, match="odd size"):
        load_corpus(str(tmp_path / "odd.bin"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no \\*.txt"):
        load_corpus(str(tmp_path / "empty"))


def test_batches_are_a_function_of_seed_and_step():
    tokens = np.arange(10_000) % 256
    a = BatchSampler(tokens=tokens, seq_len=16, batch_size=4, seed=3)
    b = BatchSampler(tokens=tokens, seq_len=16, batch_size=4, seed=3)
    np.testing.assert_array_equal(a.host_batch(7), b.host_batch(7))
    assert not np.array_equal(a.host_batch(7), a.host_batch(8))
    val = BatchSampler(tokens=tokens, seq_len=16, batch_size=4, seed=3, stream=1)
    assert not np.array_equal(a.host_batch(7), val.host_batch(7))
    batch = a.host_batch(0)
    assert batch.shape == (4, 17)
    np.testing.assert_array_equal(batch[:, 1:], (batch[:, :-1] + 1) % 256)  # contiguous windows


def test_device_batch_equals_host_batch_on_a_sharded_mesh():
    mesh = make_mesh("data=4,tensor=2")
    sharding = NamedSharding(mesh, PartitionSpec(None, "data", None))
    sampler = BatchSampler(tokens=np.arange(5000) % 251, seq_len=8, batch_size=8, seed=0)
    arr = sampler.device_batch(5, sharding, microbatches=2)
    assert arr.shape == (2, 4, 9) and arr.sharding == sharding
    np.testing.assert_array_equal(np.asarray(arr).reshape(8, 9), sampler.host_batch(5))
    assert len(arr.addressable_shards) == jax.device_count()


def test_too_short_corpus():
    with pytest.raises(UserError, match="seq-len"):
        BatchSampler(tokens=np.zeros(10), seq_len=16, batch_size=1, seed=0)
