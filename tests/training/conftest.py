"""Fixtures shared by the training tests."""

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """One persistent compilation cache for the session, for this process and its children:
    runs that compile identical programs (the tiny model again and again) reuse them."""
    path = tmp_path_factory.getbasetemp() / "jax-cache"
    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(path))
    compilation_cache.reset_cache()
    yield path
    jax.config.update("jax_compilation_cache_dir", old)
    compilation_cache.reset_cache()
