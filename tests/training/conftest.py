"""Fixtures shared by the training tests."""

import jax
import pytest
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

PIPELINE_LAYERS = 8  # the pipeline tests' model: `tiny` with 8 layers


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


@pytest.fixture(scope="module")
def model():
    """The pipeline tests' model (test_pipeline.py, test_pipeline_spmd.py): `tiny` with
    PIPELINE_LAYERS layers, initialised on one device: (config, graphdef, parameters)."""
    from oases_jax.mesh import make_mesh
    from oases_jax.models import get_preset
    from oases_jax.models.sharding import init_sharded
    from oases_jax.rules import get_rules

    cfg = get_preset("tiny").replace(n_layers=PIPELINE_LAYERS)
    one = make_mesh("data=1", jax.devices()[:1])
    graphdef, params = nnx.split(init_sharded(cfg, get_rules("dp"), one, 0))
    return cfg, graphdef, params
