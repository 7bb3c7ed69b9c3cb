"""Hugging Face interop: load GPT-2 / LLaMA safetensors checkpoints straight onto a mesh, and
export a model back to the Hugging Face layout (config.json + model.safetensors)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from safetensors.numpy import save_file

from oases_jax.errors import UserError
from oases_jax.files import read_json
from oases_jax.models.config import ModelConfig
from oases_jax.models.hf_config import config_from_hf, config_to_hf
from oases_jax.models.hf_tensors import Checkpoint
from oases_jax.models.layers import rope_frequencies
from oases_jax.models.sharding import abstract_model, param_shardings
from oases_jax.models.transformer import Transformer
from oases_jax.rules import ShardingRules, get_rules

# Tensor names of a GPT-2 checkpoint may carry the prefix of GPT2LMHeadModel or not (GPT2Model).
_PREFIXES = {"gpt2": ("transformer.", ""), "llama": ("",)}


# HF -> ours. Each entry reads one HF tensor (of layer i for block parameters) and converts it.


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One HF tensor (`template` formatted with the layer index) and its conversion."""

    template: str
    shape: tuple[int, ...]
    convert: Callable[[np.ndarray], np.ndarray] = lambda a: a

    def name(self, i: int = 0) -> str:
        return self.template.format(i=i)

    def __call__(self, ckpt: Checkpoint, i: int = 0) -> np.ndarray:
        return self.convert(ckpt.read(self.name(i), self.shape))


_t = _Entry


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    return np.pad(a, ((0, rows - a.shape[0]), (0, 0)))  # zero rows for the padded vocabulary


def _untied(cfg: ModelConfig, top: dict) -> dict:
    return {k: e for k, e in top.items() if k != "head" or not cfg.tied}  # tied: no head


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
    return layer, _untied(cfg, top)


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
    return layer, _untied(cfg, top)


def _layer_of(name: str) -> int | None:
    match = re.search(r"(?:^|\.)(?:h|layers)\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def _check_buffer(ckpt: Checkpoint, cfg: ModelConfig, name: str) -> bool:
    """Whether unused tensor `name` is a buffer of what our blocks compute (GPT-2's causal mask
    `attn.bias` and `attn.masked_bias`, LLaMA's `rotary_emb.inv_freq`, a tied head's copy of the
    embedding); such a buffer is checked against our computation and counted as used."""
    layer = _layer_of(name)
    if layer is not None and layer >= cfg.n_layers:
        return False
    p, k = cfg.max_seq_len, cfg.k_dim
    if cfg.family == "gpt2" and name.endswith(".attn.bias"):
        want = np.tril(np.ones((p, p), bool))[None, None]
        check = lambda a: a.shape == want.shape and np.array_equal(a != 0, want)  # noqa: E731
    elif cfg.family == "gpt2" and name.endswith(".attn.masked_bias"):
        check = lambda a: a.size == 1 and float(a.reshape(())) <= -1e4  # noqa: E731
    elif cfg.family == "llama" and name.endswith(".self_attn.rotary_emb.inv_freq"):
        want = np.asarray(rope_frequencies(cfg))
        check = lambda a: a.shape == (k // 2,) and np.allclose(a, want, rtol=1e-5)  # noqa: E731
    elif name == "lm_head.weight" and cfg.tied:
        want = ckpt.read_raw(ckpt.name("wte.weight" if cfg.family == "gpt2"
                                       else "model.embed_tokens.weight"))
        check = lambda a: np.array_equal(a, want)  # noqa: E731
    else:
        return False
    if not check(np.asarray(ckpt.read_raw(name))):
        raise UserError(f"tensor {name!r} in {ckpt.path} does not match what config.json "
                        "describes (a mask, rotary frequencies or tied head of other settings); "
                        "use the checkpoint's own config.json")
    ckpt.used.add(name)
    return True


def _check_headers(ckpt: Checkpoint, cfg: ModelConfig, layer: dict, top: dict) -> None:
    """Every tensor the model needs is present with a float dtype and its shape, and every
    tensor present is needed: from the headers, before any weight is read."""
    for entry in top.values():
        ckpt.check(entry.name(), entry.shape)
    for i in range(cfg.n_layers):  # stops at the first missing layer, whatever n_layers says
        for entry in layer.values():
            ckpt.check(entry.name(i), entry.shape)
    unused = [n for n in ckpt.unused() if not _check_buffer(ckpt, cfg, n)]
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        index = _layer_of(unused[0])
        why = (f"layer {index} is beyond config.json's {cfg.n_layers} layers"
               if index is not None and index >= cfg.n_layers
               else "the model config.json describes has no such parameter")
        raise UserError(f"tensor {unused[0]!r}{more} in {ckpt.path} is not used: {why}; a "
                        "checkpoint loads whole or not at all, so use its own config.json")


def load_hf(
    path: str | os.PathLike,
    *,
    rules: ShardingRules | str,
    mesh: Mesh,
    dtype: str = "float32",
    remat: str = "none",
    scan_layers: bool = True,
) -> Transformer:
    """Load a Hugging Face GPT-2 or LLaMA checkpoint directory, each parameter born on its shard.

    The model is exactly the checkpoint's, or a one-line UserError says why not: config keys
    are read by `models.hf_config`, every tensor's header is checked before any is read, and a
    tensor the model does not use is refused.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(
            f"checkpoint directory {path} does not exist; pass a Hugging Face model directory "
            "holding config.json and *.safetensors"
        )
    if not (path / "config.json").exists():
        raise UserError(f"checkpoint directory {path} has no config.json; add the model's config")
    rules = get_rules(rules) if isinstance(rules, str) else rules
    cfg = config_from_hf(
        read_json(path / "config.json", "config.json", "use the model's own config.json"),
        dtype=dtype, remat=remat,
        scan_layers=scan_layers
    )
    ckpt = Checkpoint(path, _PREFIXES[cfg.family])
    layer, top = (_gpt2_import if cfg.family == "gpt2" else _llama_import)(cfg)
    _check_headers(ckpt, cfg, layer, top)
    graphdef, abstract = abstract_model(cfg)
    shardings = param_shardings(abstract, rules, mesh)  # checks divisibility before any reading

    def place(keypath, var: nnx.Variable, sharding) -> nnx.Variable:
        name = ".".join(str(getattr(p, "key", p)) for p in keypath)
        if name.startswith("blocks."):
            host = np.stack([layer[name[7:]](ckpt, i) for i in range(cfg.n_layers)])
        else:
            host = top[name](ckpt)
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
