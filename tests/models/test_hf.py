"""Hugging Face interop: tiny random checkpoints, checked against plain-numpy forward passes written
from the Hugging Face GPT-2 and LLaMA definitions (not from our model code), and every way a
checkpoint could load as a different model refused in one line."""

import json
import os

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import oases_jax.models.hf
import oases_jax.models.hf_tensors
from oases_jax.errors import UserError
from oases_jax.models import hf_config
from oases_jax.models.hf import config_from_hf, config_to_hf, export_hf, load_hf
from oases_jax.models.layers import rope_frequencies
from oases_jax.models.sharding import abstract_model, param_shardings
from oases_jax.rules import get_rules
from tests.models.hf_reference import (
    GPT2,
    KINDS,
    LLAMA,
    LLAMA3,
    LLAMA3_LEGACY,
    TOKENS,
    VOCAB,
    forward,
    gpt2_tensors,
    inv_frequencies,
    llama_layer,
    llama_reference,
    make_checkpoint,
    mesh_of,
    params,
    reference,
    write_checkpoint,
)
from tests.models.hf_reference import llama_tensors as _llama_tensors

MESHES = [
    ("data=1", "dp"),
    ("data=2,tensor=4", "tp"),
    ("data=8", "fsdp"),
    ("data=2,tensor=4", "fsdp_tp"),
]


# Tests.


@pytest.mark.parametrize("mesh_text,rules_name", MESHES)
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_hf_reference(tmp_path, kind, mesh_text, rules_name):
    config, tensors = make_checkpoint(kind, tmp_path)
    mesh, rules = mesh_of(mesh_text), get_rules(rules_name)
    model = load_hf(tmp_path, rules=rules, mesh=mesh)
    logits = forward(model, TOKENS, rules, mesh)
    want = reference(config, tensors, TOKENS)
    np.testing.assert_allclose(logits[..., :VOCAB], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(model.embed[...])[VOCAB:], 0.0)
    # Every parameter sits on the sharding the rules give it.
    want_shardings = nnx.to_flat_state(param_shardings(abstract_model(model.cfg)[1], rules, mesh))
    got = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, sharding in want_shardings:
        if isinstance(sharding, nnx.Variable):  # param_shardings keeps the Variable wrappers
            sharding = sharding.get_value()
        array = got[path].get_value()
        assert array.sharding.is_equivalent_to(sharding, array.ndim), (path, array.sharding)


def test_options_reach_the_config(tmp_path):
    config, tensors = make_checkpoint("llama", tmp_path)
    mesh, rules = mesh_of("data=2,tensor=4"), get_rules("tp")
    model = load_hf(tmp_path, rules="tp", mesh=mesh, remat="full", scan_layers=False)
    assert (model.cfg.remat, model.cfg.scan_layers, model.cfg.tied) == ("full", False, False)
    want = llama_reference(config, tensors, TOKENS)
    np.testing.assert_allclose(
        forward(model, TOKENS, rules, mesh)[..., :VOCAB], want, rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("kind", KINDS)
def test_export_round_trip(tmp_path, kind):
    config, tensors = make_checkpoint(kind, tmp_path / "src")
    mesh = mesh_of("data=2,tensor=4")
    model = load_hf(tmp_path / "src", rules="tp", mesh=mesh)
    export_hf(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    exported = load_file(tmp_path / "out" / "model.safetensors")
    if kind == "gpt2_bare":  # we always write GPT2LMHeadModel's names
        exported = {k.removeprefix("transformer."): a for k, a in exported.items()}
    assert {k: a.shape for k, a in exported.items()} == {k: a.shape for k, a in tensors.items()}
    for key, array in tensors.items():
        np.testing.assert_array_equal(exported[key], array.astype(np.float32), err_msg=key)
    hf_config = json.loads((tmp_path / "out" / "config.json").read_text())
    if not {"rope_parameters", "rope_scaling"} & set(config):  # rope: the layout all read
        assert {k: hf_config[k] for k in config} == config
    assert config_to_hf(config_from_hf(hf_config)) == config_to_hf(config_from_hf(config))
    reloaded = load_hf(tmp_path / "out", rules="fsdp", mesh=mesh_of("data=8"))
    assert config_to_hf(reloaded.cfg) == config_to_hf(model.cfg)
    want = params(model)
    for name, array in params(reloaded).items():
        np.testing.assert_array_equal(array, want[name], err_msg=name)


def test_export_into_empty_dir(tmp_path):
    make_checkpoint("llama_tied", tmp_path / "src")
    model = load_hf(tmp_path / "src", rules="dp", mesh=mesh_of("data=1"))
    (tmp_path / "out").mkdir()
    export_hf(model, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_export_refuses_to_overwrite(tmp_path):
    make_checkpoint("gpt2", tmp_path / "src")
    model = load_hf(tmp_path / "src", rules="dp", mesh=mesh_of("data=1"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match=r"export path .*out already exists and is not empty"):
        export_hf(model, tmp_path / "out")
    with pytest.raises(UserError, match="not empty"):
        export_hf(model, tmp_path / "out" / "keep.txt")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_export_failure_leaves_nothing(tmp_path, monkeypatch):
    make_checkpoint("gpt2", tmp_path / "src")
    model = load_hf(tmp_path / "src", rules="dp", mesh=mesh_of("data=1"))

    def fail(tensors, file, metadata=None):
        open(file, "wb").write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(oases_jax.models.hf, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        export_hf(model, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _drop(key):
    def mutate(path, config, tensors):
        write_checkpoint(path, config, {k: a for k, a in tensors.items() if k != key})

    return mutate


def _reshape(key, shape):
    def mutate(path, config, tensors):
        write_checkpoint(path, config, tensors | {key: np.zeros(shape, np.float32)})

    return mutate


def _config(**changes):
    def mutate(path, config, tensors):
        write_checkpoint(
            path, {k: v for k, v in (config | changes).items() if v != "DROP"}, tensors
        )

    return mutate


def _remove(name):
    def mutate(path, config, tensors):
        write_checkpoint(path, config, tensors, shards=2)
        (path / name).unlink()

    return mutate


def _add(extra: dict):
    def mutate(path, config, tensors):
        write_checkpoint(path, config, tensors | extra)

    return mutate


def _fifo(name: str):
    def mutate(path, config, tensors):
        write_checkpoint(path, config, tensors)
        (path / name).unlink()
        os.mkfifo(path / name)  # opening it for reading would wait for a writer forever

    return mutate


def _index(change):
    def mutate(path, config, tensors):
        write_checkpoint(path, config, tensors, shards=2)
        index = json.loads((path / "model.safetensors.index.json").read_text())
        index["weight_map"] = change(index["weight_map"])
        (path / "model.safetensors.index.json").write_text(json.dumps(index))

    return mutate


def _config_only(path, config, tensors):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))


def _corrupt(keep_bytes):
    def mutate(path, config, tensors):
        write_checkpoint(path, config, tensors)
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[:keep_bytes] if keep_bytes else b"garbage!")

    return mutate


def _raw_config(text):
    def mutate(path, config, tensors):
        write_checkpoint(path, config, tensors)
        (path / "config.json").write_text(text)

    return mutate


BAD_INPUTS = {
    "missing_dir": (lambda path, c, t: None, r"nope does not exist"),
    "missing_config": (_remove("config.json"), r"has no config\.json"),
    "no_safetensors": (_config_only, r"no \*\.safetensors files in"),
    "missing_shard": (
        _remove("model-00002-of-00002.safetensors"),
        r"lists shard model-00002-of-00002\.safetensors, which is missing",
    ),
    "unknown_model_type": (_config(model_type="bert"), r"model_type 'bert' is not supported"),
    "missing_config_field": (_config(hidden_size="DROP"), r"has no 'hidden_size'"),
    "unsupported_option": (
        _config(rope_scaling={"type": "linear", "factor": 2.0}),
        r"rope_type='linear' is not implemented",
    ),
    "bad_json": (_raw_config("{not json"), r"config\.json '.*config\.json' is not valid JSON"),
    "missing_tensor": (
        _drop("model.layers.1.mlp.down_proj.weight"),
        r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight' is missing",
    ),
    "wrong_shape": (
        _reshape("model.layers.0.self_attn.k_proj.weight", (64, 64)),
        r"k_proj\.weight' in .* has shape \(64, 64\) but config\.json implies "
        r"\(32, 64\)",
    ),
    "corrupt_file": (_corrupt(0), r"model\.safetensors is corrupt or truncated"),
    "truncated_file": (_corrupt(-100), r"model\.safetensors is corrupt or truncated"),
    # Every tensor is used, with the dtype and shape the config implies.
    "extra_tensor": (
        _add({"model.extra.weight": np.zeros(4, np.float32)}),
        r"tensor 'model\.extra\.weight' in .* is not used: the model config\.json describes has "
        r"no such parameter",
    ),
    "q_proj_bias": (  # a Qwen-style checkpoint: loading it as a Llama would drop its biases
        _add({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}),
        r"tensor 'model\.layers\.0\.self_attn\.q_proj\.bias' in .* is not used",
    ),
    "third_layer": (
        _add(llama_layer(LLAMA, np.random.default_rng(1), 2)),
        r"tensor 'model\.layers\.2\.input_layernorm\.weight' \(and 8 more\) in .* is not "
        r"used: layer 2 is beyond config\.json's 2 layers",
    ),
    "int32_weight": (
        _add({"model.norm.weight": np.ones(64, np.int32)}),
        r"tensor 'model\.norm\.weight' in .* is stored as I32; a weight is one of F64, F32",
    ),
    # config.json that is not a config, or holds values of the wrong type.
    "config_list": (_raw_config("[1, 2]"), r"config\.json holds a list, not an object"),
    "size_as_string": (
        _config(hidden_size="64"), r"hidden_size='64' must be a positive integer"),
    "size_as_float": (
        _config(num_hidden_layers=2.0), r"num_hidden_layers=2\.0 must be a positive integer"),
    "size_as_bool": (
        _config(num_attention_heads=True), r"num_attention_heads=True must be a positive"),
    "rope_theta_string": (
        _config(rope_theta="10000"), r"rope_theta='10000' must be a positive finite number"),
    "nan": (_raw_config('{"model_type": "llama", "rms_norm_eps": NaN}'),
            r"config\.json': rms_norm_eps = NaN: JSON numbers must be finite"),
    "duplicate_key": (_raw_config('{"model_type": "llama", "model_type": "gpt2"}'),
                      r"config\.json': model_type is given twice"),
    "deep_nesting": (_raw_config("[" * 100000 + "]" * 100000),
                     r"nests lists or objects more than 32 deep"),
    "unknown_key": (_config(qk_layernorm=True), r"config\.json key 'qk_layernorm' is not known"),
    "architecture": (
        _config(architectures=["LlamaForSequenceClassification"]),
        r"architecture 'LlamaForSequenceClassification' is not read by this loader",
    ),
    # Rope settings we do not implement, or that contradict each other.
    "rope_yarn": (
        _config(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
        r"rope_type='yarn' is not implemented",
    ),
    "llama3_missing_factor": (
        _config(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
        r"rope_type 'llama3' needs 'low_freq_factor'",
    ),
    "llama3_extra_setting": (
        _config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
                              "attention_factor": 2.0}),
        r"rope setting 'attention_factor' is not implemented for rope_type 'llama3'",
    ),
    "llama3_bad_band": (
        _config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
        r"0 < low_freq_factor < high_freq_factor",
    ),
    "two_rope_layouts": (
        _config(rope_scaling={"rope_type": "default"}, rope_parameters={"rope_type": "default"}),
        r"has both rope_parameters and rope_scaling",
    ),
    "theta_conflict": (
        _config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        r"rope_theta=10000\.0 disagrees with rope_parameters rope_theta=500000\.0",
    ),
    # Files that are not what their names say.
    "config_fifo": (_fifo("config.json"), r"config\.json '.*' is a FIFO, not a regular file"),
    "weights_fifo": (_fifo("model.safetensors"),
                     r"model\.safetensors' is a FIFO, not a regular file"),
    "index_escapes": (
        _index(lambda m: {k: "../model-00001-of-00002.safetensors" for k in m}),
        r"names shard '\.\./model-00001-of-00002\.safetensors', which is not a file name",
    ),
    "index_misplaces": (
        _index(lambda m: {k: "model-00001-of-00002.safetensors" for k in m}),
        r"index\.json maps tensor '.*' to model-00001-of-00002\.safetensors, which does not "
        r"hold it",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_a_user_error(tmp_path, case):
    mutate, message = BAD_INPUTS[case]
    path = tmp_path / "nope"
    mutate(path, LLAMA, _llama_tensors(LLAMA, np.random.default_rng(0)))
    with pytest.raises(UserError, match=message) as info:
        load_hf(path, rules="tp", mesh=mesh_of("data=2,tensor=4"))
    assert "\n" not in str(info.value)


def test_mesh_that_does_not_divide_is_a_user_error(tmp_path):
    make_checkpoint("llama", tmp_path)  # 4 KV heads cannot split over tensor=8
    with pytest.raises(UserError, match=r"kv_heads=4\) is not divisible by mesh axis tensor=8"):
        load_hf(tmp_path, rules="tp", mesh=mesh_of("tensor=8"))


def test_config_from_hf_overrides():
    cfg = config_from_hf(LLAMA, dtype="bfloat16")
    assert (cfg.family, cfg.dtype, cfg.tied) == ("llama", "bfloat16", False)
    assert (cfg.kv_heads, cfg.k_dim, cfg.ff_dim, cfg.padded_vocab) == (4, 8, 160, 384)


def test_index_and_files_disagree(tmp_path):
    config, tensors = LLAMA, _llama_tensors(LLAMA, np.random.default_rng(0))
    write_checkpoint(tmp_path, config, tensors, shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = next(  # the other shard, which exists but does not hold it
        f for f in set(index["weight_map"].values()) if f != index["weight_map"][key])
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=rf"tensor '{key}' is in .* but the index maps it to"):
        load_hf(tmp_path, rules="dp", mesh=mesh_of("data=1"))


# Each key that changes the computation is loaded exactly or refused.


def _other_value(allowed: tuple):
    """A value outside `allowed` of the same kind (a bool flipped, a string or size instead of
    null)."""
    first = allowed[0]
    if isinstance(first, bool):
        return not first
    return "relu" if isinstance(first, str) else 4096


@pytest.mark.parametrize("family,key", [
    (family, key) for family, table in hf_config._PINNED.items() for key in table])
def test_each_pinned_key_is_refused(tmp_path, family, key):
    """Every key of the pinned table (computation we do not implement) is refused, naming it."""
    base, tensors = (GPT2, gpt2_tensors(GPT2, np.random.default_rng(0))) if family == "gpt2" \
        else (LLAMA, _llama_tensors(LLAMA, np.random.default_rng(0)))
    value = _other_value(hf_config._PINNED[family][key])
    write_checkpoint(tmp_path, base | {key: value}, tensors)
    with pytest.raises(UserError, match=rf"config\.json {key}={value!r} is not implemented"):
        load_hf(tmp_path, rules="dp", mesh=mesh_of("data=1"))
    # The allowed values load (the refusal is about the value, not the key).
    for allowed in hf_config._PINNED[family][key]:
        write_checkpoint(tmp_path, base | {key: allowed}, tensors)
        load_hf(tmp_path, rules="dp", mesh=mesh_of("data=1"))


@pytest.mark.parametrize("value", [
    {"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0}, {"rope_type": "longrope"}, {"type": "su"}])
@pytest.mark.parametrize("layout", ["rope_scaling", "rope_parameters"])
def test_other_rope_types_are_refused(value, layout):
    kind = value.get("rope_type", value.get("type"))
    with pytest.raises(UserError, match=rf"rope_type={kind!r} is not implemented"):
        config_from_hf(LLAMA | {layout: value})


def test_gpt2_config_with_fewer_layers_than_the_checkpoint(tmp_path):
    write_checkpoint(tmp_path, GPT2 | {"n_layer": 1}, gpt2_tensors(GPT2, np.random.default_rng(0)))
    with pytest.raises(UserError, match=r"tensor 'h\.1\.attn\.c_attn\.bias' \(and 11 more\) .* "
                       r"layer 1 is beyond config\.json's 1 layers"):
        load_hf(tmp_path, rules="dp", mesh=mesh_of("data=1"))


def test_gpt2_names_with_and_without_prefix_are_refused(tmp_path):
    tensors = gpt2_tensors(GPT2, np.random.default_rng(0))
    write_checkpoint(tmp_path, GPT2, tensors | {"transformer.ln_f.bias": tensors["ln_f.bias"]})
    with pytest.raises(UserError, match=r"tensor 'ln_f\.bias' in .* is not used"):
        load_hf(tmp_path, rules="dp", mesh=mesh_of("data=1"))


def test_headers_are_checked_before_any_weight_is_read(tmp_path, monkeypatch):
    """A wrong dtype in the last tensor is refused before the first tensor's bytes are read."""
    tensors = _llama_tensors(LLAMA, np.random.default_rng(0))
    tensors["model.layers.1.mlp.down_proj.weight"] = np.zeros((64, 160), np.int32)
    write_checkpoint(tmp_path, LLAMA, tensors)

    def no_reading(self, name):
        raise AssertionError(f"read {name} before checking every header")

    monkeypatch.setattr(oases_jax.models.hf_tensors.Checkpoint, "read_raw", no_reading)
    with pytest.raises(UserError, match=r"down_proj\.weight' in .* is stored as I32"):
        load_hf(tmp_path, rules="dp", mesh=mesh_of("data=1"))


# Buffers some checkpoints carry: checked against what we compute, then counted as used.


def test_buffers_of_what_we_compute_load(tmp_path):
    p = GPT2["n_positions"]
    tensors = gpt2_tensors(GPT2, np.random.default_rng(0), "transformer.")
    for i in range(GPT2["n_layer"]):
        tensors[f"transformer.h.{i}.attn.bias"] = np.tril(np.ones((p, p), np.uint8))[None, None]
        tensors[f"transformer.h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    write_checkpoint(tmp_path / "gpt2", GPT2, tensors)
    model = load_hf(tmp_path / "gpt2", rules="dp", mesh=mesh_of("data=1"))
    want = reference(GPT2, tensors, TOKENS)
    got = forward(model, TOKENS, get_rules("dp"), mesh_of("data=1"))[..., :VOCAB]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    k = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    tensors = _llama_tensors(LLAMA, np.random.default_rng(0))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv_frequencies(
        k, LLAMA["rope_theta"], None).astype(np.float32)
    write_checkpoint(tmp_path / "llama", LLAMA, tensors)
    load_hf(tmp_path / "llama", rules="dp", mesh=mesh_of("data=1"))


@pytest.mark.parametrize("case", ["mask", "inv_freq", "tied_head"])
def test_buffers_that_disagree_are_refused(tmp_path, case):
    if case == "mask":  # a mask that is not causal
        config, tensors = GPT2, gpt2_tensors(GPT2, np.random.default_rng(0))
        p = GPT2["n_positions"]
        tensors["h.0.attn.bias"] = np.ones((1, 1, p, p), np.uint8)
    elif case == "inv_freq":  # frequencies of another theta than config.json says
        config, tensors = LLAMA, _llama_tensors(LLAMA, np.random.default_rng(0))
        tensors["model.layers.1.self_attn.rotary_emb.inv_freq"] = inv_frequencies(
            8, 500000.0, None).astype(np.float32)
    else:  # tie_word_embeddings true, but a head that is not the embedding
        config = LLAMA | {"tie_word_embeddings": True}
        tensors = _llama_tensors(LLAMA, np.random.default_rng(0))
    write_checkpoint(tmp_path, config, tensors)
    with pytest.raises(UserError, match=r"does not match what config\.json describes"):
        load_hf(tmp_path, rules="dp", mesh=mesh_of("data=1"))


def test_tied_head_equal_to_the_embedding_loads(tmp_path):
    config = LLAMA | {"tie_word_embeddings": True}
    tensors = _llama_tensors(config, np.random.default_rng(0))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    write_checkpoint(tmp_path, config, tensors)
    assert load_hf(tmp_path, rules="dp", mesh=mesh_of("data=1")).cfg.tied


# Llama-3 rope scaling.


def test_llama3_scaling_changes_these_logits():
    """The Llama-3 checkpoints of the logits test would fail it if the scaling were ignored:
    their unscaled reference is far from the scaled one."""
    tensors = _llama_tensors(LLAMA3, np.random.default_rng(0))
    scaled = llama_reference(LLAMA3, tensors, TOKENS)
    unscaled = llama_reference(LLAMA3, tensors, TOKENS, scaled=False)
    assert np.abs(scaled - unscaled).max() > 100 * 1e-4


@pytest.mark.parametrize("theta,factor,low,high,context", [
    (500000.0, 8.0, 1.0, 4.0, 8192), (500000.0, 8.0, 1.0, 4.0, 256), (10000.0, 32.0, 1.0, 32.0, 64),
    (10000.0, 2.0, 0.5, 1.5, 100)])
def test_rope_frequencies_match_transformers(theta, factor, low, high, context):
    cfg = config_from_hf(LLAMA | {"hidden_size": 256, "num_attention_heads": 2,
                                  "num_key_value_heads": 2, "rope_parameters": {
                                      "rope_type": "llama3", "rope_theta": theta,
                                      "factor": factor, "low_freq_factor": low,
                                      "high_freq_factor": high,
                                      "original_max_position_embeddings": context}}
                         | {"rope_theta": theta})
    want = inv_frequencies(128, theta, {"factor": factor, "low_freq_factor": low,
                                        "high_freq_factor": high,
                                        "original_max_position_embeddings": context})
    np.testing.assert_allclose(np.asarray(rope_frequencies(cfg)), want, rtol=2e-6)


def test_rope_layouts_agree():
    current, legacy = config_from_hf(LLAMA3), config_from_hf(LLAMA3_LEGACY)
    assert current == legacy
    assert (current.rope_theta, current.rope_scaling_factor, current.rope_low_freq_factor,
            current.rope_high_freq_factor, current.rope_original_max_len) == (
        500000.0, 8.0, 1.0, 4.0, 256)
    assert config_from_hf(LLAMA).rope_scaling_factor == 1.0  # off unless config.json asks
    plain = config_from_hf({k: v for k, v in LLAMA.items() if k != "rope_theta"}
                           | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    assert plain == config_from_hf(LLAMA)
