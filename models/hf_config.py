"""Hugging Face config.json -> ModelConfig, exactly or not at all: every key of a supported
architecture is either loaded (typed and range-checked), pinned to the one value our blocks
implement, or listed as not changing the computation; any other key or value is refused."""

from __future__ import annotations

import math

from oases_jax.errors import UserError
from oases_jax.models.config import ModelConfig

_MAX_SIZE = 2**31 - 1  # sizes are array dimensions
_REQUIRED = object()

# HF key -> (ModelConfig field, kind, default when absent (_REQUIRED: must be given), attribute
# exported). Kinds: "size" a positive integer, "size?" one or null, "positive" a finite float
# above 0, "bool".
_MAPPED = {
    "gpt2": {
        "vocab_size": ("vocab_size", "size", _REQUIRED, "vocab_size"),
        "n_embd": ("d_model", "size", _REQUIRED, "d_model"),
        "n_layer": ("n_layers", "size", _REQUIRED, "n_layers"),
        "n_head": ("n_heads", "size", _REQUIRED, "n_heads"),
        "n_inner": ("d_ff", "size?", None, "ff_dim"),
        "n_positions": ("max_seq_len", "size", _REQUIRED, "max_seq_len"),
        "layer_norm_epsilon": ("norm_eps", "positive", 1e-5, "norm_eps"),
        "tie_word_embeddings": ("tie_embeddings", "bool", True, "tied"),
    },
    "llama": {
        "vocab_size": ("vocab_size", "size", _REQUIRED, "vocab_size"),
        "hidden_size": ("d_model", "size", _REQUIRED, "d_model"),
        "num_hidden_layers": ("n_layers", "size", _REQUIRED, "n_layers"),
        "num_attention_heads": ("n_heads", "size", _REQUIRED, "n_heads"),
        "num_key_value_heads": ("n_kv_heads", "size?", None, "kv_heads"),
        "head_dim": ("head_dim", "size?", None, "k_dim"),
        "intermediate_size": ("d_ff", "size", _REQUIRED, "ff_dim"),
        "max_position_embeddings": ("max_seq_len", "size", 2048, "max_seq_len"),
        "rms_norm_eps": ("norm_eps", "positive", 1e-6, "norm_eps"),
        "tie_word_embeddings": ("tie_embeddings", "bool", False, "tied"),
    },
}
# Keys that change the computation, pinned to the values our blocks implement (the first is
# the default when absent and what we export). Any other value is refused.
_PINNED = {
    "gpt2": {
        "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # tanh GELU; not erf "gelu"
        "scale_attn_weights": (True,),
        "scale_attn_by_inverse_layer_idx": (False,),
        "reorder_and_upcast_attn": (False,),
        "add_cross_attention": (False,),
    },
    "llama": {
        "hidden_act": ("silu",),
        "attention_bias": (False,),  # Qwen-style q/k/v biases
        "mlp_bias": (False,),
        "sliding_window": (None,),  # Mistral-style local attention
    },
}
# Keys that do not change the function the weights compute. Dropout is training-time
# regularisation (our runs train without it); pretraining_tp splits the same matmuls; the
# storage dtype is read from each tensor's header; the rest name, generate or label.
_GENERIC = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
    "_name_or_path", "name_or_path", "initializer_range", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "id2label",
    "label2id", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
    "task_specific_params", "return_dict", "output_attentions", "output_hidden_states",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "tie_encoder_decoder", "cross_attention_hidden_size",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
}
_IGNORED = {
    "gpt2": _GENERIC | {
        "n_ctx", "attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_type", "summary_use_proj",
        "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
    },
    "llama": _GENERIC | {"attention_dropout", "pretraining_tp"},
}
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")  # llama only
# Llama-3 scaling: HF key -> ModelConfig field.
_LLAMA3 = {
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_len",
}
ARCHITECTURES = {"gpt2": ("GPT2LMHeadModel", "GPT2Model"), "llama": ("LlamaForCausalLM",
                                                                      "LlamaModel")}


def _typed(key: str, value, kind: str):
    """`value` of config key `key` checked as `kind` (see _MAPPED)."""
    ok = {
        "size": isinstance(value, int) and not isinstance(value, bool)
        and 0 < value <= _MAX_SIZE,
        "size?": value is None or isinstance(value, int) and not isinstance(value, bool)
        and 0 < value <= _MAX_SIZE,
        "positive": isinstance(value, int | float) and not isinstance(value, bool)
        and math.isfinite(value) and value > 0,
        "bool": isinstance(value, bool),
    }[kind]
    if not ok:
        want = {"size": f"a positive integer (at most {_MAX_SIZE})",
                "size?": "a positive integer or null", "positive": "a positive finite number",
                "bool": "true or false"}[kind]
        raise UserError(f"config.json {key}={value!r} must be {want}; fix config.json")
    return float(value) if kind == "positive" else value


def _rope(hf: dict) -> dict:
    """ModelConfig rope fields from either layout: transformers' current `rope_parameters`
    ({"rope_type", "rope_theta", factors}) or the older top-level `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    if params is not None and scaling is not None:
        raise UserError("config.json has both rope_parameters and rope_scaling; keep one "
                        "(rope_parameters is the current layout)")
    rope = params if params is not None else scaling if scaling is not None else {}
    if not isinstance(rope, dict):
        key = "rope_parameters" if params is not None else "rope_scaling"
        raise UserError(f"config.json {key}={rope!r} must be an object; fix config.json")
    rope = dict(rope)
    theta = hf.get("rope_theta")
    if "rope_theta" in rope:
        inner = rope.pop("rope_theta")
        if theta is not None and inner != theta:
            raise UserError(f"config.json rope_theta={theta!r} disagrees with rope_parameters "
                            f"rope_theta={inner!r}; keep one")
        theta = inner
    fields = {"rope_theta": _typed("rope_theta", 10000.0 if theta is None else theta,
                                   "positive")}
    kind = rope.pop("rope_type", None)
    legacy = rope.pop("type", None)  # transformers' older name for rope_type
    if kind is not None and legacy is not None and kind != legacy:
        raise UserError(f"config.json rope_type={kind!r} disagrees with type={legacy!r}; keep "
                        "one")
    kind = kind if kind is not None else legacy if legacy is not None else "default"
    if kind not in ("default", "llama3"):
        raise UserError(f"config.json rope_type={kind!r} is not implemented (supported: "
                        "'default', 'llama3'); use a checkpoint with one of those")
    allowed = _LLAMA3 if kind == "llama3" else {}
    extra = sorted(set(rope) - set(allowed))
    if extra:
        raise UserError(f"config.json rope setting {extra[0]!r} is not implemented for "
                        f"rope_type {kind!r}; remove it only if the checkpoint was not trained "
                        "with it")
    for key, field in allowed.items():
        if key not in rope:
            raise UserError(f"config.json rope_type 'llama3' needs {key!r}; add it")
        kind_of = "size" if key == "original_max_position_embeddings" else "positive"
        fields[field] = _typed(key, rope[key], kind_of)
    return fields


def _check_architectures(hf: dict, family: str) -> None:
    names = hf.get("architectures")
    if names is None:
        return
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
        raise UserError(f"config.json architectures={names!r} must be a list of class names")
    bad = [n for n in names if n not in ARCHITECTURES[family]]
    if bad:
        raise UserError(f"config.json architecture {bad[0]!r} is not read by this loader (it "
                        f"reads {', '.join(ARCHITECTURES[family])}); use a causal LM checkpoint")


def config_from_hf(hf, **overrides) -> ModelConfig:
    """Our ModelConfig for a Hugging Face config.json value; `overrides` set dtype, remat, ...

    Refuses (one UserError line) anything it would otherwise load as a different model.
    """
    if not isinstance(hf, dict):
        raise UserError(f"config.json holds a {type(hf).__name__}, not an object; use the "
                        "model's config.json")
    family = hf.get("model_type")
    if family not in _MAPPED:
        raise UserError(f"config.json model_type {family!r} is not supported; use a gpt2 or "
                        "llama checkpoint")
    known = set(_MAPPED[family]) | set(_PINNED[family]) | _IGNORED[family]
    known |= set(_ROPE_KEYS) if family == "llama" else set()
    unknown = sorted(set(hf) - known, key=str)
    if unknown:
        raise UserError(f"config.json key {unknown[0]!r} is not known for model_type {family!r}"
                        "; it may change the computation, so the checkpoint is refused (see "
                        "models/hf_config.py for the keys read)")
    for key, allowed in _PINNED[family].items():
        value = hf.get(key, allowed[0])
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise UserError(f"config.json {key}={value!r} is not implemented for model_type "
                            f"{family!r} (supported: {', '.join(map(repr, allowed))})")
    _check_architectures(hf, family)
    fields = {}
    for key, (field, kind, default, _) in _MAPPED[family].items():
        if key not in hf and default is _REQUIRED:
            raise UserError(f"config.json (model_type {family!r}) has no {key!r}; add it")
        fields[field] = _typed(key, hf[key], kind) if key in hf else default
    if family == "llama":
        fields |= _rope(hf)
    try:
        return ModelConfig(family=family, **fields, **overrides)
    except UserError as e:
        raise UserError(f"config.json describes an invalid model: {e}") from None


def config_to_hf(cfg: ModelConfig) -> dict:
    """The Hugging Face config.json dict for `cfg` (inverse of `config_from_hf`), in the rope
    layout every transformers version reads (top-level rope_theta and rope_scaling)."""
    out = {
        "model_type": cfg.family,
        "architectures": [ARCHITECTURES[cfg.family][0]],
        **{key: getattr(cfg, attr) for key, (*_, attr) in _MAPPED[cfg.family].items()},
        **{key: allowed[0] for key, allowed in _PINNED[cfg.family].items()},
        "torch_dtype": "float32",
    }
    if cfg.family == "llama":
        out["rope_theta"] = cfg.rope_theta
        out["rope_scaling"] = None if cfg.rope_scaling_factor == 1.0 else {
            "rope_type": "llama3", **{k: getattr(cfg, f) for k, f in _LLAMA3.items()}}
    return out
