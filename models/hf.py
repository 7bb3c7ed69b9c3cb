"""Hugging Face interop: load GPT-2 / LLaMA safetensors checkpoints straight onto a mesh, and
export a model back to the Hugging Face layout (config.json + model.safetensors)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from models.config import ModelConfig
from models.sharding import abstract_model, param_shardings
from models.transformer import Transformer
from oases_jax.errors import UserError
from oases_jax.rules import ShardingRules, get_rules

# Options our blocks implement; any other value would silently load a different model.
_SUPPORTED = {
    "gpt2": {
        "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
        "scale_attn_weights": (True,),
        "scale_attn_by_inverse_layer_idx": (False,),
    },
    "llama": {
        "hidden_act": ("silu",),
        "rope_scaling": (None,),
        "attention_bias": (False,),
        "mlp_bias": (False,),
    },
}
# Tensor names of a GPT-2 checkpoint may carry the prefix of GPT2LMHeadModel or not (GPT2Model).
_PREFIXES = {"gpt2": ("transformer.", ""), "llama": ("",)}
_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
_REQUIRED = object()
# HF config key -> (ModelConfig field it sets, ModelConfig attribute exported, default if absent).
_CONFIG_KEYS = {
    "gpt2": {
        "vocab_size": ("vocab_size", "vocab_size", _REQUIRED),
        "n_embd": ("d_model", "d_model", _REQUIRED),
        "n_layer": ("n_layers", "n_layers", _REQUIRED),
        "n_head": ("n_heads", "n_heads", _REQUIRED),
        "n_inner": ("d_ff", "ff_dim", None),
        "n_positions": ("max_seq_len", "max_seq_len", _REQUIRED),
        "layer_norm_epsilon": ("norm_eps", "norm_eps", 1e-5),
        "tie_word_embeddings": ("tie_embeddings", "tied", True),
    },
    "llama": {
        "vocab_size": ("vocab_size", "vocab_size", _REQUIRED),
        "hidden_size": ("d_model", "d_model", _REQUIRED),
        "num_hidden_layers": ("n_layers", "n_layers", _REQUIRED),
        "num_attention_heads": ("n_heads", "n_heads", _REQUIRED),
        "num_key_value_heads": ("n_kv_heads", "kv_heads", None),
        "head_dim": ("head_dim", "k_dim", None),
        "intermediate_size": ("d_ff", "ff_dim", _REQUIRED),
        "max_position_embeddings": ("max_seq_len", "max_seq_len", 2048),
        "rms_norm_eps": ("norm_eps", "norm_eps", 1e-6),
        "rope_theta": ("rope_theta", "rope_theta", 10000.0),
        "tie_word_embeddings": ("tie_embeddings", "tied", False),
    },
}


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """Our ModelConfig for a Hugging Face config.json dict; `overrides` set dtype, remat, ..."""
    family = hf.get("model_type")
    if family not in _SUPPORTED:
        raise UserError(
            f"config.json model_type {family!r} is not supported; use a gpt2 or llama checkpoint"
        )
    for key, allowed in _SUPPORTED[family].items():
        if hf.get(key, allowed[0]) not in allowed:
            raise UserError(
                f"config.json {key}={hf[key]!r} is not supported for model_type {family!r}; "
                f"supported values: {allowed}"
            )
    fields = {}
    for key, (field, _, default) in _CONFIG_KEYS[family].items():
        if default is _REQUIRED and key not in hf:
            raise UserError(f"config.json (model_type {family!r}) has no {key!r}; add it")
        fields[field] = hf.get(key, default)
    return ModelConfig(family=family, **fields, **overrides)


def config_to_hf(cfg: ModelConfig) -> dict:
    """The Hugging Face config.json dict for `cfg` (inverse of `config_from_hf`)."""
    return {
        "model_type": cfg.family,
        "architectures": [_ARCHITECTURES[cfg.family]],
        **{key: getattr(cfg, attr) for key, (_, attr, _) in _CONFIG_KEYS[cfg.family].items()},
        **{key: allowed[0] for key, allowed in _SUPPORTED[cfg.family].items()},
        "torch_dtype": "float32",
    }


# Reading checkpoints.


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{file} is not valid JSON ({e}); re-download or fix it") from None


def _corrupt(file: Path, e: Exception) -> UserError:
    return UserError(f"safetensors file {file} is corrupt or truncated ({e}); re-download it")


def _safetensors_files(path: Path) -> list[Path]:
    """The shard files named by the index (sharded checkpoints), else every *.safetensors file."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise UserError(
                f"no *.safetensors files in {path}; save the checkpoint with "
                "save_pretrained(safe_serialization=True)"
            )
        return files
    files = sorted({path / f for f in _read_json(index).get("weight_map", {}).values()})
    for f in files:
        if not f.exists():
            raise UserError(f"{index} lists shard {f.name}, which is missing; fetch every shard")
    return files


class _Tensors:
    """A checkpoint's tensors by name. Files are memory-mapped, so one tensor is read at a time."""

    def __init__(self, path: Path, prefixes: tuple[str, ...]):
        self.path, self.prefixes, self.where = path, prefixes, {}
        for file in _safetensors_files(path):
            try:
                handle = safe_open(file, framework="np")
            except SafetensorError as e:
                raise _corrupt(file, e) from None
            self.where |= {key: (file, handle) for key in handle.keys()}

    def __call__(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        name = next((p + key for p in self.prefixes if p + key in self.where), None)
        if name is None:
            raise UserError(
                f"tensor {key!r} is missing from the safetensors files in "
                f"{self.path}; the checkpoint does not match its config.json"
            )
        file, handle = self.where[name]
        try:
            array = handle.get_tensor(name)
        except SafetensorError as e:
            raise _corrupt(file, e) from None
        if array.shape != shape:
            raise UserError(
                f"tensor {name!r} in {file} has shape {array.shape} but config.json "
                f"implies {shape}; use the config.json that matches the checkpoint"
            )
        return array.astype(np.float32)  # parameters are float32 whatever the checkpoint holds


# HF -> ours. Each entry reads one HF tensor (of layer i for block parameters) and converts it.


def _t(template: str, shape: tuple[int, ...], convert=lambda a: a):
    return lambda get, i=0: convert(get(template.format(i=i), shape))


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    return np.pad(a, ((0, rows - a.shape[0]), (0, 0)))  # zero rows for the padded vocabulary


def _gpt2_import(cfg: ModelConfig) -> tuple[dict, dict]:
    d, h, k, f = cfg.d_model, cfg.n_heads, cfg.k_dim, cfg.ff_dim
    v, vp = cfg.vocab_size, cfg.padded_vocab

    def qkv(j: int, suffix: str):
        # Conv1D weights are [in, out]; c_attn's output is [q | k | v], each head-major (H, K).
        cols = slice(j * d, (j + 1) * d)
        if suffix == "weight":
            return _t("h.{i}.attn.c_attn.weight", (d, 3 * d), lambda a: a[:, cols].reshape(d, h, k))
        return _t("h.{i}.attn.c_attn.bias", (3 * d,), lambda a: a[cols].reshape(h, k))

    layer = {
        "norm1.scale": _t("h.{i}.ln_1.weight", (d,)),
        "norm1.bias": _t("h.{i}.ln_1.bias", (d,)),
        "norm2.scale": _t("h.{i}.ln_2.weight", (d,)),
        "norm2.bias": _t("h.{i}.ln_2.bias", (d,)),
        "attn.wq": qkv(0, "weight"),
        "attn.wk": qkv(1, "weight"),
        "attn.wv": qkv(2, "weight"),
        "attn.bq": qkv(0, "bias"),
        "attn.bk": qkv(1, "bias"),
        "attn.bv": qkv(2, "bias"),
        "attn.wo": _t("h.{i}.attn.c_proj.weight", (d, d), lambda a: a.reshape(h, k, d)),
        "attn.bo": _t("h.{i}.attn.c_proj.bias", (d,)),
        "mlp.w_in": _t("h.{i}.mlp.c_fc.weight", (d, f)),
        "mlp.b_in": _t("h.{i}.mlp.c_fc.bias", (f,)),
        "mlp.w_out": _t("h.{i}.mlp.c_proj.weight", (f, d)),
        "mlp.b_out": _t("h.{i}.mlp.c_proj.bias", (d,)),
    }
    top = {
        "embed": _t("wte.weight", (v, d), lambda a: _pad_rows(a, vp)),
        "pos": _t("wpe.weight", (cfg.max_seq_len, d)),
        "norm_f.scale": _t("ln_f.weight", (d,)),
        "norm_f.bias": _t("ln_f.bias", (d,)),
        "head": _t("lm_head.weight", (v, d), lambda a: _pad_rows(a, vp).T),
    }
    return layer, top


def _llama_import(cfg: ModelConfig) -> tuple[dict, dict]:
    d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.k_dim, cfg.ff_dim
    v, vp = cfg.vocab_size, cfg.padded_vocab
    pre = "model.layers.{i}."
    # torch Linear weights are [out, in]; q/k/v outputs are head-major (H, K).
    layer = {
        "norm1.scale": _t(pre + "input_layernorm.weight", (d,)),
        "norm2.scale": _t(pre + "post_attention_layernorm.weight", (d,)),
        "attn.wq": _t(pre + "self_attn.q_proj.weight", (h * k, d), lambda a: a.T.reshape(d, h, k)),
        "attn.wk": _t(pre + "self_attn.k_proj.weight", (g * k, d), lambda a: a.T.reshape(d, g, k)),
        "attn.wv": _t(pre + "self_attn.v_proj.weight", (g * k, d), lambda a: a.T.reshape(d, g, k)),
        "attn.wo": _t(pre + "self_attn.o_proj.weight", (d, h * k), lambda a: a.T.reshape(h, k, d)),
        "mlp.w_gate": _t(pre + "mlp.gate_proj.weight", (f, d), np.transpose),
        "mlp.w_in": _t(pre + "mlp.up_proj.weight", (f, d), np.transpose),
        "mlp.w_out": _t(pre + "mlp.down_proj.weight", (d, f), np.transpose),
    }
    top = {
        "embed": _t("model.embed_tokens.weight", (v, d), lambda a: _pad_rows(a, vp)),
        "norm_f.scale": _t("model.norm.weight", (d,)),
        "head": _t("lm_head.weight", (v, d), lambda a: _pad_rows(a, vp).T),
    }
    return layer, top


def load_hf(
    path: str | os.PathLike,
    *,
    rules: ShardingRules | str,
    mesh: Mesh,
    dtype: str = "float32",
    remat: str = "none",
    scan_layers: bool = True,
) -> Transformer:
    """Load a Hugging Face GPT-2 or LLaMA checkpoint directory, each parameter born on its shard."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(
            f"checkpoint directory {path} does not exist; pass a Hugging Face model directory "
            "holding config.json and *.safetensors"
        )
    if not (path / "config.json").is_file():
        raise UserError(f"checkpoint directory {path} has no config.json; add the model's config")
    rules = get_rules(rules) if isinstance(rules, str) else rules
    cfg = config_from_hf(
        _read_json(path / "config.json"), dtype=dtype, remat=remat, scan_layers=scan_layers
    )
    get = _Tensors(path, _PREFIXES[cfg.family])
    layer, top = (_gpt2_import if cfg.family == "gpt2" else _llama_import)(cfg)
    graphdef, abstract = abstract_model(cfg)
    shardings = param_shardings(abstract, rules, mesh)  # checks divisibility before any reading

    def place(keypath, var: nnx.Variable, sharding) -> nnx.Variable:
        name = ".".join(str(getattr(p, "key", p)) for p in keypath)
        if name.startswith("blocks."):
            host = np.stack([layer[name[7:]](get, i) for i in range(cfg.n_layers)])
        else:
            host = top[name](get)
        assert host.shape == var.get_value().shape, (name, host.shape)
        if isinstance(sharding, nnx.Variable):  # param_shardings keeps the Variable wrappers
            sharding = sharding.get_value()
        return var.replace(jax.make_array_from_callback(host.shape, sharding, lambda i: host[i]))

    state = jax.tree_util.tree_map_with_path(
        place, abstract, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return nnx.merge(graphdef, state)


# Ours -> HF.


def _gpt2_export(cfg: ModelConfig, p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    d, v = cfg.d_model, cfg.vocab_size
    if cfg.kv_heads != cfg.n_heads or cfg.n_heads * cfg.k_dim != d:
        raise UserError(
            f"GPT-2 export needs n_kv_heads == n_heads and n_heads*head_dim == "
            f"d_model, got {cfg.kv_heads}, {cfg.n_heads}*{cfg.k_dim} vs {d}; "
            "export a model of the Hugging Face GPT-2 shape"
        )
    out = {
        "wte.weight": p["embed"][:v],
        "wpe.weight": p["pos"],
        "ln_f.weight": p["norm_f.scale"],
        "ln_f.bias": p["norm_f.bias"],
    }
    for i in range(cfg.n_layers):
        b = {name[7:]: a[i] for name, a in p.items() if name.startswith("blocks.")}
        out |= {
            f"h.{i}.{key}": a
            for key, a in {
                "ln_1.weight": b["norm1.scale"],
                "ln_1.bias": b["norm1.bias"],
                "ln_2.weight": b["norm2.scale"],
                "ln_2.bias": b["norm2.bias"],
                "attn.c_attn.weight": np.concatenate(
                    [b[n].reshape(d, d) for n in ("attn.wq", "attn.wk", "attn.wv")], axis=1
                ),
                "attn.c_attn.bias": np.concatenate(
                    [b[n].reshape(d) for n in ("attn.bq", "attn.bk", "attn.bv")]
                ),
                "attn.c_proj.weight": b["attn.wo"].reshape(d, d),
                "attn.c_proj.bias": b["attn.bo"],
                "mlp.c_fc.weight": b["mlp.w_in"],
                "mlp.c_fc.bias": b["mlp.b_in"],
                "mlp.c_proj.weight": b["mlp.w_out"],
                "mlp.c_proj.bias": b["mlp.b_out"],
            }.items()
        }
    out = {"transformer." + key: a for key, a in out.items()}  # GPT2LMHeadModel's names
    if not cfg.tied:
        out["lm_head.weight"] = p["head"][:, :v].T
    return out


def _llama_export(cfg: ModelConfig, p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    d, v = cfg.d_model, cfg.vocab_size
    out = {"model.embed_tokens.weight": p["embed"][:v], "model.norm.weight": p["norm_f.scale"]}
    for i in range(cfg.n_layers):
        b = {name[7:]: a[i] for name, a in p.items() if name.startswith("blocks.")}
        out |= {
            f"model.layers.{i}.{key}": a
            for key, a in {
                "input_layernorm.weight": b["norm1.scale"],
                "post_attention_layernorm.weight": b["norm2.scale"],
                "self_attn.q_proj.weight": b["attn.wq"].reshape(d, -1).T,
                "self_attn.k_proj.weight": b["attn.wk"].reshape(d, -1).T,
                "self_attn.v_proj.weight": b["attn.wv"].reshape(d, -1).T,
                "self_attn.o_proj.weight": b["attn.wo"].reshape(-1, d).T,
                "mlp.gate_proj.weight": b["mlp.w_gate"].T,
                "mlp.up_proj.weight": b["mlp.w_in"].T,
                "mlp.down_proj.weight": b["mlp.w_out"].T,
            }.items()
        }
    if not cfg.tied:
        out["lm_head.weight"] = p["head"][:, :v].T
    return out


def _fetch(a: jax.Array) -> np.ndarray:
    # A collective when shards live on other processes: every process must call export_hf.
    if a.is_fully_addressable:
        return np.asarray(jax.device_get(a))
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def export_hf(model: Transformer, path: str | os.PathLike) -> None:
    """Write `model` as a Hugging Face directory (config.json + model.safetensors, float32).

    Call it on every process; process 0 writes. The directory appears whole or not at all.
    """
    path, cfg = Path(path), model.cfg
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        raise UserError(
            f"export path {path} already exists and is not empty; pass a new path "
            "or remove it first"
        )
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    params = {".".join(map(str, keypath)): _fetch(var.get_value()) for keypath, var in flat}
    tensors = (_gpt2_export if cfg.family == "gpt2" else _llama_export)(cfg, params)
    if jax.process_index() == 0:
        _write_atomic(
            path, {k: np.ascontiguousarray(a) for k, a in tensors.items()}, config_to_hf(cfg)
        )
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("export_hf")  # nobody reads before the rename


def _write_atomic(path: Path, tensors: dict[str, np.ndarray], config: dict) -> None:
    # A temp dir in the same parent, so the final rename is atomic (same file system).
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; an exported model is meant to be shared
        if path.exists():
            path.rmdir()  # an empty directory (checked by the caller); rename cannot replace it
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
