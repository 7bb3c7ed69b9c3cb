"""Hugging Face interop: tiny random checkpoints, checked against plain-numpy forward passes written
from the Hugging Face GPT-2 and LLaMA definitions (not from our model code)."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import models.hf
from models.hf import config_from_hf, config_to_hf, export_hf, load_hf
from models.sharding import abstract_model, param_shardings
from oases_jax.errors import UserError
from oases_jax.mesh import make_mesh
from oases_jax.rules import get_rules, use_rules

VOCAB, SEQ = 300, 16  # 300 is not a multiple of 128, so the embedding gets padded

GPT2 = dict(
    model_type="gpt2",
    vocab_size=VOCAB,
    n_embd=64,
    n_layer=2,
    n_head=4,
    n_positions=64,
    layer_norm_epsilon=1e-5,
    activation_function="gelu_new",
)
LLAMA = dict(
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=160,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
)

# kind -> (config, gpt2 key prefix, number of safetensors shards, stored dtype)
KINDS = {
    "gpt2": (GPT2, "transformer.", 1, np.float32),  # as GPT2LMHeadModel.save_pretrained writes
    "gpt2_bare": (GPT2, "", 2, np.float32),  # as the original GPT2Model checkpoints: no prefix
    "llama": (LLAMA, "", 3, np.float32),
    "llama_tied": (LLAMA | {"tie_word_embeddings": True}, "", 1, np.float32),
    "llama_bf16": (LLAMA, "", 1, ml_dtypes.bfloat16),  # as most LLaMA checkpoints are stored
}


# Checkpoints.


def _gpt2_tensors(c: dict, rng: np.random.Generator, prefix: str) -> dict[str, np.ndarray]:
    d = c["n_embd"]
    n = lambda *shape: (0.1 * rng.standard_normal(shape)).astype(np.float32)
    t = {
        "wte.weight": n(VOCAB, d),
        "wpe.weight": n(c["n_positions"], d),
        "ln_f.weight": 1 + n(d),
        "ln_f.bias": n(d),
    }
    for i in range(c["n_layer"]):
        t |= {
            f"h.{i}.{key}": a
            for key, a in {
                "ln_1.weight": 1 + n(d),
                "ln_1.bias": n(d),
                "ln_2.weight": 1 + n(d),
                "ln_2.bias": n(d),
                "attn.c_attn.weight": n(d, 3 * d),
                "attn.c_attn.bias": n(3 * d),
                "attn.c_proj.weight": n(d, d),
                "attn.c_proj.bias": n(d),
                "mlp.c_fc.weight": n(d, 4 * d),
                "mlp.c_fc.bias": n(4 * d),
                "mlp.c_proj.weight": n(4 * d, d),
                "mlp.c_proj.bias": n(d),
            }.items()
        }
    return {prefix + key: a for key, a in t.items()}


def _llama_tensors(c: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    d, f, k = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    h, g = c["num_attention_heads"], c["num_key_value_heads"]
    n = lambda *shape: (0.1 * rng.standard_normal(shape)).astype(np.float32)
    t = {"model.embed_tokens.weight": n(VOCAB, d), "model.norm.weight": 1 + n(d)}
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = n(VOCAB, d)
    for i in range(c["num_hidden_layers"]):
        t |= {
            f"model.layers.{i}.{key}": a
            for key, a in {
                "input_layernorm.weight": 1 + n(d),
                "post_attention_layernorm.weight": 1 + n(d),
                "self_attn.q_proj.weight": n(h * k, d),
                "self_attn.k_proj.weight": n(g * k, d),
                "self_attn.v_proj.weight": n(g * k, d),
                "self_attn.o_proj.weight": n(d, h * k),
                "mlp.gate_proj.weight": n(f, d),
                "mlp.up_proj.weight": n(f, d),
                "mlp.down_proj.weight": n(d, f),
            }.items()
        }
    return t


def write_checkpoint(path, config: dict, tensors: dict, shards: int = 1) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return
    names = [f"model-{j + 1:05d}-of-{shards:05d}.safetensors" for j in range(shards)]
    weight_map = {key: names[j % shards] for j, key in enumerate(sorted(tensors))}
    for name in names:
        save_file({k: a for k, a in tensors.items() if weight_map[k] == name}, path / name)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def make_checkpoint(kind: str, path, seed: int = 0) -> tuple[dict, dict]:
    config, prefix, shards, dtype = KINDS[kind]
    rng = np.random.default_rng(seed)
    if config["model_type"] == "gpt2":
        tensors = _gpt2_tensors(config, rng, prefix)
    else:
        tensors = _llama_tensors(config, rng)
    tensors = {k: a.astype(dtype) for k, a in tensors.items()}
    write_checkpoint(path, config, tensors, shards)
    return config, tensors


# Plain-numpy references (float64), following transformers' modeling_gpt2 / modeling_llama.


def _layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + eps) * w + b


def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * w


def _heads(x, n):  # [B, L, n*K] -> [B, n, L, K]
    b, length, _ = x.shape
    return x.reshape(b, length, n, -1).transpose(0, 2, 1, 3)


def _attention(q, k, v):  # [B, H, L, K] each -> [B, L, H*K]
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    length = q.shape[2]
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    out = (probs / probs.sum(-1, keepdims=True)) @ v
    b, h, _, kd = out.shape
    return out.transpose(0, 2, 1, 3).reshape(b, length, h * kd)


def _gelu_new(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def gpt2_reference(c: dict, tensors: dict, tokens: np.ndarray) -> np.ndarray:
    t = {k.removeprefix("transformer."): a.astype(np.float64) for k, a in tensors.items()}
    h, eps = c["n_head"], c["layer_norm_epsilon"]
    x = t["wte.weight"][tokens] + t["wpe.weight"][: tokens.shape[1]]
    for i in range(c["n_layer"]):
        p = {k.removeprefix(f"h.{i}."): a for k, a in t.items() if k.startswith(f"h.{i}.")}
        a = _layer_norm(x, p["ln_1.weight"], p["ln_1.bias"], eps)
        q, k, v = np.split(a @ p["attn.c_attn.weight"] + p["attn.c_attn.bias"], 3, axis=-1)
        o = _attention(_heads(q, h), _heads(k, h), _heads(v, h))
        x = x + o @ p["attn.c_proj.weight"] + p["attn.c_proj.bias"]
        m = _layer_norm(x, p["ln_2.weight"], p["ln_2.bias"], eps)
        m = _gelu_new(m @ p["mlp.c_fc.weight"] + p["mlp.c_fc.bias"])
        x = x + m @ p["mlp.c_proj.weight"] + p["mlp.c_proj.bias"]
    x = _layer_norm(x, t["ln_f.weight"], t["ln_f.bias"], eps)
    return x @ t["wte.weight"].T  # GPT2LMHeadModel ties lm_head to wte


def _rope(x, theta):  # [B, H, L, K]; LlamaRotaryEmbedding + rotate_half
    length, k = x.shape[2], x.shape[3]
    inv_freq = 1.0 / theta ** (np.arange(0, k, 2) / k)
    freqs = np.arange(length)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], -1)
    rotated = np.concatenate([-x[..., k // 2 :], x[..., : k // 2]], -1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def llama_reference(c: dict, tensors: dict, tokens: np.ndarray) -> np.ndarray:
    t = {k: a.astype(np.float64) for k, a in tensors.items()}
    h, g, eps = c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    x = t["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        p = {k.removeprefix(pre): a for k, a in t.items() if k.startswith(pre)}
        a = _rms_norm(x, p["input_layernorm.weight"], eps)
        q = _rope(_heads(a @ p["self_attn.q_proj.weight"].T, h), c["rope_theta"])
        k = _rope(_heads(a @ p["self_attn.k_proj.weight"].T, g), c["rope_theta"])
        v = _heads(a @ p["self_attn.v_proj.weight"].T, g)
        k, v = np.repeat(k, h // g, axis=1), np.repeat(v, h // g, axis=1)  # repeat_kv
        x = x + _attention(q, k, v) @ p["self_attn.o_proj.weight"].T
        m = _rms_norm(x, p["post_attention_layernorm.weight"], eps)
        gate = m @ p["mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (m @ p["mlp.up_proj.weight"].T)) @ (
            p["mlp.down_proj.weight"].T
        )
    x = _rms_norm(x, t["model.norm.weight"], eps)
    return x @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T


REFERENCE = {"gpt2": gpt2_reference, "llama": llama_reference}


# Helpers.


def mesh_of(text: str):
    devices = jax.devices()[:1] if text == "data=1" else jax.devices()
    return make_mesh(text, devices)


def forward(model, tokens, rules, mesh) -> np.ndarray:
    with jax.set_mesh(mesh), use_rules(rules, mesh):
        return np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))


def params(model) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, path)): np.asarray(var.get_value()) for path, var in flat}


TOKENS = np.random.default_rng(1).integers(0, VOCAB, (4, SEQ))
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
    want = REFERENCE[config["model_type"]](config, tensors, TOKENS)
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
    assert {k: hf_config[k] for k in config} == config
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

    monkeypatch.setattr(models.hf, "save_file", fail)
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
        r"rope_scaling=.*is not supported",
    ),
    "bad_json": (_raw_config("{not json"), r"config\.json is not valid JSON"),
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
