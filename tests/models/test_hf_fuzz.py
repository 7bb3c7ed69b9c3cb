"""Fuzz of the Hugging Face loader (`models.hf.load_hf`): seeded mutations of a tiny checkpoint's
config.json and of its safetensors files. Each must load exactly (logits equal, to 1e-4, to the
float64 reference of what the files hold) or be refused with one UserError line, within seconds:
never a traceback, a hang, or a silently different model.

config.json categories (a Llama-3 checkpoint in the current layout, or a GPT-2 one):
  type     a read key's value as a string, float, bool, null, list or object
  range    zero, negative, beyond int32, 10^30, 1e400 (infinite), a fraction
  missing  a required key removed
  unknown  a key no table lists (computation the loader does not know)
  pinned   a computation not implemented: sliding_window, attention/mlp biases, other
           activations, reorder_and_upcast_attn, cross-attention, another architecture
  rope     other rope types, llama3 factors missing, extra, mistyped or inconsistent, both
           layouts, disagreeing thetas
  syntax   not an object, truncated, duplicate keys, NaN/Infinity, deep nesting, bad UTF-8,
           empty, a directory or a FIFO
  neutral  (must load) keys reordered, ignored keys added, pinned keys at their implemented
           values, rope settings moved between layouts, integers for floats

safetensors categories:
  truncated  the file cut anywhere
  length     the header-length field zero, one off, huge
  header     the header not JSON, a list, a tensor entry without dtype, shape or offsets,
             duplicate names, overlapping or out-of-range offsets
  flip       a random byte of the header changed (either outcome, but exact if it loads)
  dtype      a weight stored as an integer, bool or fp8 type, or its header dtype rewritten
             (an I32 where an F32 belongs, same bytes)
  shape      a weight transposed, short, with an extra dim, or its header shape rewritten
  extra      a tensor the model does not use: a stray name, a third layer, a q_proj.bias, a
             head beside a tied embedding, a name with and without GPT-2's prefix
  missing    a tensor removed
  index      a sharded checkpoint's index: missing shard, escaping path, wrong map, not JSON
  files      a weights file that is a directory, a FIFO, empty, /dev/zero, duplicated
  neutral    (must load) re-sharded, stored as bf16, fp16 or fp64, other header metadata
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import signal
import struct
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save

from oases_jax.errors import UserError
from oases_jax.models.hf import load_hf
from oases_jax.rules import get_rules
from tests.models.hf_reference import (
    GPT2,
    LLAMA3,
    TOKENS,
    VOCAB,
    forward,
    gpt2_tensors,
    llama_layer,
    llama_tensors,
    mesh_of,
    reference,
    write_checkpoint,
)

SEED = 20
HANG_S = 10.0


@dataclasses.dataclass(frozen=True)
class Case:
    category: str
    name: str
    build: Callable[[Path], tuple[dict, dict]]  # writes the checkpoint; (config, tensors) held
    expect: str = "reject"  # "reject", "accept" or "either" (exact if it loads)


def _bases() -> dict[str, tuple[dict, dict]]:
    return {"llama3": (LLAMA3, llama_tensors(LLAMA3, np.random.default_rng(0))),
            "gpt2": (GPT2, gpt2_tensors(GPT2, np.random.default_rng(0), "transformer."))}


BASES = _bases()


def _written(config, tensors, *, text: str | None = None, shards: int = 1):
    def build(path: Path):
        write_checkpoint(path, config, tensors, shards)
        if text is not None:
            (path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
        return config, tensors

    return build


# config.json mutations.

_READ = {"llama3": ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size", "max_position_embeddings",
                    "rms_norm_eps", "tie_word_embeddings"],
         "gpt2": ["vocab_size", "n_embd", "n_layer", "n_head", "n_positions",
                  "layer_norm_epsilon"]}
_REQUIRED = {"llama3": ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "intermediate_size"],
             "gpt2": ["vocab_size", "n_embd", "n_layer", "n_head", "n_positions"]}
_PINNED = {
    "llama3": [("sliding_window", 4096), ("sliding_window", 8), ("attention_bias", True),
               ("mlp_bias", True), ("hidden_act", "gelu"), ("hidden_act", "relu"),
               ("hidden_act", None), ("architectures", ["LlamaForSequenceClassification"]),
               ("architectures", "LlamaForCausalLM")],
    "gpt2": [("reorder_and_upcast_attn", True), ("scale_attn_by_inverse_layer_idx", True),
             ("scale_attn_weights", False), ("activation_function", "gelu"),
             ("activation_function", "relu"), ("add_cross_attention", True),
             ("architectures", ["GPT2DoubleHeadsModel"])],
}
_UNKNOWN = [("qk_layernorm", True), ("use_sliding_window", True), ("quantization_config",
            {"quant_method": "gptq"}), ("rope_scaling_factor", 2.0), ("num_experts", 8),
            ("partial_rotary_factor", 0.5), ("attn_logit_softcapping", 50.0),
            ("hidden_activation", "gelu"), ("layer_types", ["full_attention"])]
_IGNORED = [("use_cache", False), ("bos_token_id", 1), ("eos_token_id", [1, 2]),
            ("transformers_version", "4.99.0"), ("torch_dtype", "bfloat16"),
            ("initializer_range", 0.5), ("_name_or_path", "x/y"), ("pad_token_id", None),
            ("task_specific_params", {"text-generation": {"do_sample": True}})]
_IGNORED_BY = {"llama3": [("pretraining_tp", 2), ("attention_dropout", 0.1),
                          ("architectures", ["LlamaForCausalLM"]), ("attention_bias", False),
                          ("mlp_bias", False), ("sliding_window", None), ("hidden_act", "silu")],
               "gpt2": [("attn_pdrop", 0.1), ("n_ctx", 64), ("summary_type", "cls_index"),
                        ("architectures", ["GPT2LMHeadModel"]), ("scale_attn_weights", True),
                        ("activation_function", "gelu_pytorch_tanh"),
                        ("reorder_and_upcast_attn", False)]}
_LLAMA3_ROPE = LLAMA3["rope_parameters"]


def _with(config: dict, **changes) -> dict:
    out = dict(config)
    for key, value in changes.items():
        if value is _DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


_DROP = object()


def _rope(**changes) -> dict:
    return {k: v for k, v in (_LLAMA3_ROPE | changes).items() if v is not _DROP}


def config_cases(rng: random.Random) -> list[Case]:
    cases = []

    def add(category, name, config, expect="reject", text=None, base="llama3"):
        _, tensors = BASES[base]
        cases.append(Case(category, f"{base}:{name}", _written(config, tensors, text=text),
                          expect))

    for base in ("llama3", "gpt2"):
        config = BASES[base][0]
        for key in rng.sample(_READ[base], 5):
            value = config[key]
            swaps = [str(value), None, [value], {"value": value}]
            swaps += [float(value) + 0.5, True] if isinstance(value, int) else [str(value)]
            swap = rng.choice(swaps)
            add("type", f"{key}={swap!r}", _with(config, **{key: swap}), base=base)
        for key in rng.sample(_READ[base][:6], 4):
            bad = rng.choice([0, -1, 2**31, 10**30, 1e400, 0.25, -0.0])
            add("range", f"{key}={bad!r}", _with(config, **{key: bad}), base=base)
        for key in rng.sample(_REQUIRED[base], 3):
            add("missing", key, _with(config, **{key: _DROP}), base=base)
        for key, value in rng.sample(_UNKNOWN, 3):
            add("unknown", key, _with(config, **{key: value}), base=base)
        for key, value in _PINNED[base]:
            add("pinned", f"{key}={value!r}", _with(config, **{key: value}), base=base)
        keys = list(config)
        rng.shuffle(keys)
        add("neutral", "reordered", {k: config[k] for k in keys}, "accept", base=base)
        extra = dict(rng.sample(_IGNORED, 3) + rng.sample(_IGNORED_BY[base], 3))
        add("neutral", f"ignored {sorted(extra)}", config | extra, "accept", base=base)
        text = json.dumps(config)
        for name, bad in [("list", "[" + text + "]"), ("string", json.dumps(text)),
                          ("number", "7"), ("null", "null"), ("empty", ""),
                          ("truncated", text[: rng.randrange(1, len(text) - 1)]),
                          ("duplicate", text[:-1] + ', "model_type": "gpt2"}'),
                          ("nan", text[:-1] + ', "rms_norm_eps": NaN}'),
                          ("infinity", text[:-1] + ', "initializer_range": -Infinity}'),
                          ("nested", "[" * 50000 + "]" * 50000),
                          ("bad utf-8", text[:-1] + ', "x": "\udcff"}')]:
            add("syntax", name, config, text=bad, base=base)
    config = LLAMA3
    for name, rope in [("linear", {"rope_type": "linear", "factor": 2.0}),
                       ("dynamic", {"rope_type": "dynamic", "factor": 2.0}),
                       ("yarn", _rope(rope_type="yarn")), ("unnamed type", {"type": "su"}),
                       ("no factor", _rope(factor=_DROP)),
                       ("no low", _rope(low_freq_factor=_DROP)),
                       ("no context", _rope(original_max_position_embeddings=_DROP)),
                       ("string factor", _rope(factor="8")), ("theta string",
                                                              _rope(rope_theta="500000")),
                       ("zero factor", _rope(factor=0.0)), ("band reversed",
                                                            _rope(low_freq_factor=8.0)),
                       ("attention factor", _rope(attention_factor=1.5)),
                       ("list", [_LLAMA3_ROPE]), ("types disagree", _rope(type="linear")),
                       ("context float", _rope(original_max_position_embeddings=256.0))]:
        add("rope", name, _with(config, rope_parameters=rope))
    add("rope", "both layouts", _with(config, rope_scaling=_LLAMA3_ROPE))
    add("rope", "thetas disagree", _with(config, rope_theta=10000.0))
    legacy = _with(config, rope_parameters=_DROP, rope_theta=500000,
                   rope_scaling=_rope(rope_theta=_DROP))
    add("neutral", "legacy layout, integer theta", legacy, "accept")
    add("neutral", "theta in both places", _with(config, rope_theta=500000.0), "accept")
    plain = _with(BASES["llama3"][0], rope_parameters={"rope_type": "default",
                                                       "rope_theta": 10000.0})
    cases.append(Case("neutral", "llama3:default rope", _written(
        plain, BASES["llama3"][1]), "accept"))
    cases.append(Case("syntax", "llama3:directory", _replaced("config.json", "dir")))
    cases.append(Case("syntax", "llama3:fifo", _replaced("config.json", "fifo")))
    return cases


def _replaced(name: str, what: str, base: str = "llama3"):
    def build(path: Path):
        config, tensors = BASES[base]
        write_checkpoint(path, config, tensors)
        target = path / name
        target.unlink()
        if what == "dir":
            target.mkdir()
        elif what == "fifo":
            os.mkfifo(target)
        elif what == "empty":
            target.write_bytes(b"")
        else:  # a link to a device that never ends
            target.symlink_to("/dev/zero")
        return config, tensors

    return build


# safetensors mutations.


def _split(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _join(header, data: bytes, *, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _file(change: Callable[[bytes], bytes], base: str = "llama3"):
    """The checkpoint with its one model.safetensors rewritten as `change` says."""

    def build(path: Path):
        config, tensors = BASES[base]
        write_checkpoint(path, config, tensors)
        file = path / "model.safetensors"
        file.write_bytes(change(file.read_bytes()))
        return config, tensors

    return build


def _header(change: Callable[[dict], object], base: str = "llama3"):
    def rewrite(blob: bytes) -> bytes:
        header, data = _split(blob)
        out = change(copy.deepcopy(header))
        return _join(out, data) if not isinstance(out, bytes) else _join(None, data, raw=out)

    return _file(rewrite, base)


def _tensors(change: Callable[[dict], dict], expect="reject", base="llama3", shards=1):
    def build(path: Path):
        config, tensors = BASES[base]
        held = change(dict(tensors))
        write_checkpoint(path, config, held, shards)
        return config, held

    return build, expect


def _index_change(change: Callable[[dict], object]):
    def build(path: Path):
        config, tensors = BASES["llama3"]
        write_checkpoint(path, config, tensors, shards=2)
        index = path / "model.safetensors.index.json"
        out = change(json.loads(index.read_text()))
        index.write_text(out if isinstance(out, str) else json.dumps(out))
        return config, tensors

    return build


def checkpoint_cases(rng: random.Random) -> list[Case]:
    cases = []
    names = sorted(BASES["llama3"][1])
    size = len(save(BASES["llama3"][1], metadata={"format": "pt"}))

    def add(category, name, build, expect="reject"):
        cases.append(Case(category, name, build, expect))

    for cut in sorted(rng.sample(range(size), 7)) + [size - 1]:
        add("truncated", f"at {cut} of {size}", _file(lambda b, c=cut: b[:c]))
    for name, value in [("zero", lambda n: 0), ("one more", lambda n: n + 1),
                        ("one less", lambda n: n - 1), ("huge", lambda n: 2**63),
                        ("past the end", lambda n: size)]:
        add("length", name, _file(lambda b, v=value: struct.pack(
            "<Q", v(struct.unpack("<Q", b[:8])[0])) + b[8:]))
    first = names[0]
    for name, change in [
        ("not json", lambda h: b"{not json"), ("a list", lambda h: list(h.items())),
        ("no dtype", lambda h: h | {first: {k: v for k, v in h[first].items() if k != "dtype"}}),
        ("no shape", lambda h: h | {first: {k: v for k, v in h[first].items() if k != "shape"}}),
        ("no offsets", lambda h: h | {first: {"dtype": "F32", "shape": h[first]["shape"]}}),
        ("offsets overlap", lambda h: h | {first: h[first] | {"data_offsets": [0, 8]}}),
        ("offsets beyond", lambda h: h | {first: h[first] | {"data_offsets": [0, 10**12]}}),
        ("negative shape", lambda h: h | {first: h[first] | {"shape": [-1, 64]}}),
        ("unknown dtype", lambda h: h | {first: h[first] | {"dtype": "F33"}}),
        ("duplicate name", lambda h: json.dumps(h)[:-1].encode() + b', "' + first.encode()
         + b'": ' + json.dumps(h[first]).encode() + b"}"),
    ]:
        add("header", name, _header(change))
    header_len = struct.unpack("<Q", save(BASES["llama3"][1])[:8])[0]
    for position in rng.sample(range(8, 8 + header_len), 8):
        byte = rng.randrange(256)
        add("flip", f"byte {position} -> {byte}", _file(
            lambda b, p=position, v=byte: b[:p] + bytes([v]) + b[p + 1 :]), "either")
    for dtype in (np.int32, np.int64, np.uint8, np.bool_, ml_dtypes.float8_e4m3fn):
        key = rng.choice(names)
        add("dtype", f"{key} as {np.dtype(dtype).name}", *_tensors(
            lambda t, k=key, d=dtype: t | {k: t[k].astype(d)}))
    for key in rng.sample(names, 2):  # same bytes, the header says I32: garbage if believed
        add("dtype", f"{key} header I32", _header(
            lambda h, k=key: h | {k: h[k] | {"dtype": "I32"}}))
    for key in rng.sample([n for n in names if "proj" in n], 4):
        shape = BASES["llama3"][1][key].shape
        change = rng.choice([lambda a: a.T.copy(), lambda a: a[:-1], lambda a: a[None]])
        add("shape", f"{key} changed", *_tensors(lambda t, k=key, c=change: t | {k: c(t[k])}))
        add("shape", f"{key} header reversed", _header(
            lambda h, k=key, s=shape: h | {k: h[k] | {"shape": list(s[::-1])}}))
    extras = {
        "stray": {"model.extra.weight": np.zeros(4, np.float32)},
        "third layer": llama_layer(LLAMA3, np.random.default_rng(2), 2),
        "q_proj.bias": {"model.layers.1.self_attn.q_proj.bias": np.zeros(64, np.float32)},
        "k_norm": {"model.layers.0.self_attn.k_norm.weight": np.ones(8, np.float32)},
        "one tensor of layer 5": {"model.layers.5.mlp.up_proj.weight": np.zeros(
            (160, 64), np.float32)},
    }
    for name, extra in extras.items():
        add("extra", name, *_tensors(lambda t, e=extra: t | e))
    add("extra", "gpt2 both prefixes", *_tensors(
        lambda t: t | {"h.0.ln_1.bias": t["transformer.h.0.ln_1.bias"]}, base="gpt2"))
    add("extra", "gpt2 head beside the tied embedding", *_tensors(
        lambda t: t | {"lm_head.weight": np.ones_like(t["transformer.wte.weight"])}, base="gpt2"))
    for key in rng.sample(names, 5):
        add("missing", key, *_tensors(lambda t, k=key: {n: a for n, a in t.items() if n != k}))
    for name, change in [
        ("shard missing", lambda i: i | {"weight_map": i["weight_map"] | {
            names[0]: "model-00009-of-00009.safetensors"}}),
        ("escaping path", lambda i: {"weight_map": {k: "../" + v for k, v in
                                                    i["weight_map"].items()}}),
        ("absolute path", lambda i: {"weight_map": {k: "/etc/passwd" for k in i["weight_map"]}}),
        ("map is a list", lambda i: {"weight_map": list(i["weight_map"].items())}),
        ("no map", lambda i: {"metadata": {}}),
        ("not json", lambda i: "{weight_map"),
        ("map to the other shard", lambda i: {"weight_map": {
            k: "model-00001-of-00002.safetensors" for k in i["weight_map"]}}),
        ("tensor not in the files", lambda i: {"weight_map": i["weight_map"] | {
            "model.ghost.weight": "model-00001-of-00002.safetensors"}}),
    ]:
        add("index", name, _index_change(change))
    for what in ("dir", "fifo", "empty", "zero"):
        add("files", f"model.safetensors {what}", _replaced("model.safetensors", what))

    def duplicated(path: Path):
        config, tensors = BASES["llama3"]
        write_checkpoint(path, config, tensors)
        (path / "copy.safetensors").write_bytes((path / "model.safetensors").read_bytes())
        return config, tensors

    add("files", "two files hold the same tensors", duplicated)
    for dtype in (ml_dtypes.bfloat16, np.float16, np.float64):
        add("neutral", f"stored as {np.dtype(dtype).name}", *_tensors(
            lambda t, d=dtype: {k: a.astype(d) for k, a in t.items()}, expect="accept"))
    add("neutral", "3 shards", *_tensors(lambda t: t, expect="accept", shards=3))
    add("neutral", "other metadata", _header(
        lambda h: h | {"__metadata__": {"format": "flax", "note": "x" * 100}}), "accept")
    add("neutral", "gpt2 without prefix", *_tensors(
        lambda t: {k.removeprefix("transformer."): a for k, a in t.items()}, expect="accept",
        base="gpt2"))
    return cases


# Running a case.


class _Hang(BaseException):
    pass


def _alarm(_signum, _frame):
    raise _Hang


def outcome(case: Case, path: Path, loader=load_hf) -> str:
    """"ok", or what went wrong: "silently accepted", "valid input refused: ...",
    "wrong logits", "multiline", "hang", "traceback: Type"."""
    config, tensors = case.build(path)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    try:
        model = loader(path, rules="dp", mesh=mesh_of("data=1"))
    except UserError as e:
        if "\n" in str(e).strip():
            return "multiline"
        return f"valid input refused: {e}" if case.expect == "accept" else "ok"
    except _Hang:
        return "hang"
    except Exception as e:  # noqa: BLE001 - every other exception is the finding
        return f"traceback: {type(e).__name__}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if case.expect == "reject":
        return "silently accepted"
    got = forward(model, TOKENS, get_rules("dp"), mesh_of("data=1"))[..., :VOCAB]
    exact = np.allclose(got, reference(config, tensors, TOKENS), rtol=1e-4, atol=1e-4)
    return "ok" if exact else "wrong logits"


def tally(cases: list[Case], results: list[str]) -> dict[str, tuple[int, int]]:
    """Category -> (failures, cases)."""
    out: dict[str, list[int]] = {}
    for case, result in zip(cases, results, strict=True):
        row = out.setdefault(case.category, [0, 0])
        row[0] += result != "ok"
        row[1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


@pytest.mark.parametrize("which", ["config", "checkpoint"])
def test_mutated_checkpoints_load_exactly_or_fail_in_one_line(tmp_path, which):
    make = config_cases if which == "config" else checkpoint_cases
    cases = make(random.Random(SEED))
    assert len(cases) >= 50
    results = [outcome(case, tmp_path / f"case{i}") for i, case in enumerate(cases)]
    failures = [f"{c.category} {c.name}: {r}" for c, r in zip(cases, results, strict=True)
                if r != "ok"]
    assert not failures, f"{len(failures)} of {len(cases)} ({tally(cases, results)}):\n" + \
        "\n".join(failures)
