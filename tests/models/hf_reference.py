"""Tiny random Hugging Face checkpoints and plain-numpy (float64) forward passes written from the
transformers GPT-2 and LLaMA definitions (not from our model code), for the HF tests."""

import json

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from oases_jax.mesh import make_mesh
from oases_jax.rules import use_rules

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
# Llama-3 in transformers' current layout: rope settings under rope_parameters. With head_dim 8
# and theta 500000 the wavelengths are 6.3, 167, 4453 and 118k positions; an original context
# of 256 puts them in each band (kept below 64, blended between 64 and 256, divided above).
LLAMA3 = {k: v for k, v in LLAMA.items() if k != "rope_theta"} | dict(
    max_position_embeddings=1024,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                         low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=256),
)
# The same model in the older layout: top-level rope_theta, rope_scaling with "type".
LLAMA3_LEGACY = {k: v for k, v in LLAMA3.items() if k != "rope_parameters"} | dict(
    rope_theta=500000.0,
    rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=256),
)

# kind -> (config, gpt2 key prefix, number of safetensors shards, stored dtype)
KINDS = {
    "gpt2": (GPT2, "transformer.", 1, np.float32),  # as GPT2LMHeadModel.save_pretrained writes
    "gpt2_bare": (GPT2, "", 2, np.float32),  # as the original GPT2Model checkpoints: no prefix
    "llama": (LLAMA, "", 3, np.float32),
    "llama_tied": (LLAMA | {"tie_word_embeddings": True}, "", 1, np.float32),
    "llama_bf16": (LLAMA, "", 1, ml_dtypes.bfloat16),  # as most LLaMA checkpoints are stored
    "llama3": (LLAMA3, "", 1, np.float32),
    "llama3_legacy": (LLAMA3_LEGACY, "", 2, np.float32),
}


# Checkpoints.


def gpt2_tensors(c: dict, rng: np.random.Generator, prefix: str = "") -> dict[str, np.ndarray]:
    d = c["n_embd"]
    n = lambda *shape: (0.1 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
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


def llama_layer(c: dict, rng: np.random.Generator, i: int) -> dict[str, np.ndarray]:
    d, f, k = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    h, g = c["num_attention_heads"], c["num_key_value_heads"]
    n = lambda *shape: (0.1 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    return {
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


def llama_tensors(c: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    d = c["hidden_size"]
    n = lambda *shape: (0.1 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": n(VOCAB, d), "model.norm.weight": 1 + n(d)}
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = n(VOCAB, d)
    for i in range(c["num_hidden_layers"]):
        t |= llama_layer(c, rng, i)
    return t


def write_checkpoint(path, config, tensors: dict, shards: int = 1) -> None:
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
        tensors = gpt2_tensors(config, rng, prefix)
    else:
        tensors = llama_tensors(config, rng)
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


def rope_settings(c: dict, scaled: bool = True) -> tuple[float, dict | None]:
    """(theta, llama3 scaling parameters or None) from either rope layout of a config."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    return theta, (rope if kind == "llama3" and scaled else None)


def inv_frequencies(k: int, theta: float, scaling: dict | None) -> np.ndarray:
    """LlamaRotaryEmbedding's inv_freq; with scaling, `_compute_llama3_parameters` step by step."""
    inv_freq = 1.0 / theta ** (np.arange(0, k, 2, dtype=np.float64) / k)
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * np.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama)


def _rope(x, inv_freq):  # [B, H, L, K]; LlamaRotaryEmbedding + rotate_half
    length, k = x.shape[2], x.shape[3]
    freqs = np.arange(length)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], -1)
    rotated = np.concatenate([-x[..., k // 2 :], x[..., : k // 2]], -1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def llama_reference(c: dict, tensors: dict, tokens: np.ndarray, scaled: bool = True):
    t = {k: a.astype(np.float64) for k, a in tensors.items()}
    h, g, eps = c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    inv_freq = inv_frequencies(c["hidden_size"] // h, *rope_settings(c, scaled))
    x = t["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        p = {k.removeprefix(pre): a for k, a in t.items() if k.startswith(pre)}
        a = _rms_norm(x, p["input_layernorm.weight"], eps)
        q = _rope(_heads(a @ p["self_attn.q_proj.weight"].T, h), inv_freq)
        k = _rope(_heads(a @ p["self_attn.k_proj.weight"].T, g), inv_freq)
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


def reference(config: dict, tensors: dict, tokens: np.ndarray) -> np.ndarray:
    return REFERENCE[config["model_type"]](config, tensors, tokens)


# Running our model.


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
