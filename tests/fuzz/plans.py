"""Mutated plan files, each run through `train.py --plan` and `inspect_hlo.py --plan`."""

from __future__ import annotations

import copy
import os
import pathlib
import random
from collections.abc import Callable

from tests.fuzz import targets
from tests.fuzz.harness import Case
from tests.fuzz.jsontext import (
    Raw,
    dumps,
    label,
    nested,
    numeric_paths,
    removed,
    replaced,
    with_duplicate,
)

SEED = 20


def base_plans() -> dict[str, dict]:
    """Four valid plans of `tiny` on 8 devices: the planner's own (fsdp on data=8) with a
    model_config, a hand-made oases/megatron mix on data=2,tensor=4, the planner's primepar
    plan, and an old-style plan without format, version or model_config."""
    from oases_jax.models.presets import get_preset
    from oases_jax.planner import get_cluster, make_plan

    cfg, cluster = get_preset("tiny"), get_cluster("cpu-8")
    fsdp, _ = make_plan(cfg, model="tiny", cluster=cluster, global_batch=8, seq_len=32)
    prime, _ = make_plan(cfg, model="tiny", cluster=cluster, global_batch=8, seq_len=32,
                         schedules=("primepar",))
    mixed = copy.deepcopy(fsdp)
    mixed.update(mesh={"data": 2, "tensor": 4}, rules="tp", microbatches=1, layers=[
        {"schedule": "oases", "sub_batches": 2, "remat": "save_proj"},
        {"schedule": "megatron", "sub_batches": 1, "remat": "none"}])
    old = {"model": "tiny", "cluster": "cpu-8", "global_batch": 8, "seq_len": 32,
           "mesh": {"data": 2, "tensor": 4}, "rules": "tp", "microbatches": 2,
           "layers": [{"schedule": "megatron"},
                      {"schedule": "collective_matmul", "sub_batches": 1, "remat": "full"}],
           "predicted_step_s": 0.0125}
    return {"fsdp": fsdp, "mixed": mixed, "primepar": prime, "old": old}


INT_FIELDS = ("global_batch", "seq_len", "microbatches")
MODEL_INTS = ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "vocab_multiple")
MODEL_OPTIONAL_INTS = ("n_kv_heads", "head_dim", "d_ff")
MODEL_STRS = ("family", "dtype", "remat", "attention")
WRONG_FOR_INT = (8.5, 8.0, True, False, "8", [8], {"v": 8}, None)
WRONG_FOR_STR = (5, 1.5, True, None, ["tp"], {"name": "tp"})
WRONG_FOR_FLOAT = ("0.1", True, [0.1], {}, None)


def _paths(plan: dict) -> dict[str, list[tuple]]:
    """Paths of `plan` by the kind of value they hold."""
    layers = range(len(plan["layers"]))
    mc = plan.get("model_config")
    return {
        "int": [(k,) for k in INT_FIELDS] + [("mesh", a) for a in plan["mesh"]]
        + [("layers", i, "sub_batches") for i in layers if "sub_batches" in plan["layers"][i]]
        + ([("model_config", k) for k in MODEL_INTS] if mc else []),
        "optional_int": [("model_config", k) for k in MODEL_OPTIONAL_INTS] if mc else [],
        "str": [("rules",), ("model",)] + [("layers", i, "schedule") for i in layers]
        + [("layers", i, "remat") for i in layers if "remat" in plan["layers"][i]]
        + ([("model_config", k) for k in MODEL_STRS] if mc else []),
        "float": [("predicted_step_s",)] + ([("model_config", "norm_eps"),
                                             ("model_config", "rope_theta")] if mc else []),
        "bool": [("model_config", "scan_layers")] if mc else [],
    }


class Builder:
    """Collects (category, name, document text or path maker, expect, needle)."""

    def __init__(self, tmp: pathlib.Path):
        self.tmp = tmp
        self.cases: list[Case] = []

    def add(self, category: str, name: str, text: str | bytes | Callable, expect="reject",
            needle: str | None = None) -> None:
        path = self.tmp / f"plan-{len(self.cases):03d}.json"
        if callable(text):
            path = text(path)
        elif isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        self.cases.append(Case(category, name, _runner(str(path)), expect, needle))


def _runner(path: str):
    out = str(pathlib.Path(path).with_suffix(".run"))
    return lambda: targets.both(
        lambda: targets.train("--model", "tiny", "--plan", path, "--out-dir", out),
        lambda: targets.inspect_hlo("--plan", path))


def plan_cases(tmp: pathlib.Path) -> list[Case]:
    rng = random.Random(SEED)
    bases = base_plans()
    assert bases["fsdp"]["memory"] and bases["fsdp"]["alternatives"]  # the cases below use them
    b = Builder(tmp)
    names = list(bases)

    def pick() -> tuple[str, dict]:
        n = rng.choice(names)
        return n, bases[n]

    for n, plan in bases.items():  # valid inputs, several spellings
        b.add("valid", f"{n} as written", dumps(plan), "accept")
        b.add("valid", f"{n} compact, keys reversed", dumps(dict(reversed(plan.items())), None),
              "accept")
    b.add("valid", "version 1", dumps({**bases["fsdp"], "version": 1}), "accept")
    b.add("valid", "remat save_dots", dumps(replaced(bases["mixed"], ("layers", 1, "remat"),
                                                     "save_dots")), "accept")
    b.add("valid", "model_config dropped",
          dumps(removed(bases["fsdp"], ("model_config",))), "accept")
    b.add("valid", "rules left out (tp)", dumps(removed(bases["mixed"], ("rules",))), "accept")
    b.add("valid", "a verified block", dumps({**bases["mixed"], "verified": {"target": "local"}}),
          "accept")

    for _ in range(60):  # wrong kinds of value
        n, plan = pick()
        kind = rng.choice(["int", "int", "str", "float", "bool", "optional_int"])
        paths = _paths(plan)[kind]
        if not paths:
            continue
        path = rng.choice(paths)
        wrong = {"int": WRONG_FOR_INT, "optional_int": WRONG_FOR_INT[:-1], "str": WRONG_FOR_STR,
                 "float": WRONG_FOR_FLOAT, "bool": (1, 0, "true", 1.0, [True])}[kind]
        value = rng.choice(wrong)
        b.add("wrong_type", f"{n}: {label(path)} = {value!r}", dumps(replaced(plan, path, value)),
              needle=label(path))

    for _ in range(30):  # non-finite and overflowing numbers, anywhere
        n, plan = pick()
        path = rng.choice(numeric_paths(plan))
        text = rng.choice(["Infinity", "-Infinity", "NaN", "1e999", "-1e999"])
        b.add("non_finite", f"{n}: {label(path)} = {text}", dumps(replaced(plan, path, Raw(text))),
              needle=label(path))

    for _ in range(40):  # zero, negative and absurd sizes
        n, plan = pick()
        path = rng.choice(_paths(plan)["int"] + _paths(plan)["optional_int"])
        value = rng.choice([0, -1, -8, 10**12, 2**63, 10**30])
        b.add("range", f"{n}: {label(path)} = {value}", dumps(replaced(plan, path, value)),
              needle=label(path))
    for path, value in ((("predicted_step_s",), -1.0), (("model_config", "norm_eps"), 0.0),
                        (("model_config", "rope_theta"), -10000.0),
                        (("memory", "params"), -5.0)):
        b.add("range", f"fsdp: {label(path)} = {value}",
              dumps(replaced(bases["fsdp"], path, value)), needle=label(path))

    bad_names = {"schedule": ["warp", "Megatron", " oases", "", "xla_auto"],
                 "remat": ["FULL", "sometimes", "", "none "],
                 "rules": ["zero", "TP", "tp ", ""],
                 "family": ["gpt3"], "dtype": ["float16"], "attention": ["flash"]}
    for _ in range(25):  # unknown names
        n, plan = pick()
        paths = [p for p in _paths(plan)["str"] if p[-1] in bad_names]
        path = rng.choice(paths)
        value = rng.choice(bad_names[path[-1]])
        b.add("names", f"{n}: {label(path)} = {value!r}", dumps(replaced(plan, path, value)),
              needle=label(path))
    for axis in (" data", "Data", "tensor2", ""):
        mesh = {axis: 2, "tensor": 4}
        b.add("names", f"mixed: mesh axis {axis!r}", dumps({**bases["mixed"], "mesh": mesh}),
              needle="mesh")
    b.add("names", "unknown preset, no model_config",
          dumps({**removed(bases["fsdp"], ("model_config",)), "model": "gpt-9000"}),
          needle="model")
    b.add("names", "format of another version",
          dumps({**bases["fsdp"], "format": "oases-jax-plan/2"}), needle="format")

    structure = [
        ("top level a list", "[]", None), ("top level a string", '"plan"', None),
        ("top level a number", "5", None), ("top level null", "null", None),
        ("empty object", "{}", None),
        ("layers empty", dumps({**bases["mixed"], "layers": []}), "layers"),
        ("layers an object", dumps({**bases["mixed"], "layers": {"0": {"schedule": "oases"}}}),
         "layers"),
        ("layers a string", dumps({**bases["mixed"], "layers": "oases"}), "layers"),
        ("layer entry null", dumps(replaced(bases["mixed"], ("layers", 0), None)), "layers[0]"),
        ("layer entry a list", dumps(replaced(bases["mixed"], ("layers", 0), ["oases", 2])),
         "layers[0]"),
        ("layer entry typo", dumps(replaced(bases["mixed"], ("layers", 0),
                                            {"schedule": "oases", "sub_batch": 2})),
         "layers[0].sub_batch"),
        ("mesh a list", dumps({**bases["mixed"], "mesh": [["data", 2], ["tensor", 4]]}), "mesh"),
        ("mesh empty", dumps({**bases["mixed"], "mesh": {}}), "mesh"),
        ("rules a list", dumps({**bases["mixed"], "rules": ["tp"]}), "rules"),
        ("top-level typo", dumps({**removed(bases["mixed"], ("rules",)), "rule": "tp"}), "rule"),
        ("model_config a list", dumps({**bases["fsdp"], "model_config": []}), "model_config"),
        ("model_config unknown key",
         dumps(replaced(bases["fsdp"], ("model_config", "depth"), 3)), "model_config.depth"),
        ("baselines a list", dumps({**bases["fsdp"], "baselines": [1, 2]}), "baselines"),
        ("alternatives entry null", dumps(replaced(bases["fsdp"], ("alternatives", 0), None)),
         "alternatives[0]"),
    ]
    for field in ("mesh", "layers", "global_batch", "seq_len", "microbatches"):
        structure.append((f"missing {field}", dumps(removed(bases["mixed"], (field,))), field))
    for name, text, needle in structure:
        b.add("structure", name, text, needle=needle)

    for n, path, key, value in (("mixed", ("mesh",), "data", 4),
                                ("mixed", (), "global_batch", 16),
                                ("mixed", ("layers", 0), "schedule", "megatron"),
                                ("fsdp", ("model_config",), "n_layers", 2),
                                ("old", (), "rules", "tp"), ("primepar", (), "mesh", {"data": 8}),
                                ("fsdp", ("memory",), next(iter(bases["fsdp"]["memory"])), 1.0),
                                ("primepar", ("layers", 1), "remat", "full")):
        doc = with_duplicate(bases[n], path, key, value)
        b.add("duplicate_keys", f"{n}: {label((*path, key))} twice",
              doc if isinstance(doc, str) else dumps(doc), needle=key)

    for depth, kind in ((40, "list"), (40, "dict"), (5000, "list"), (100_000, "list"),
                        (100_000, "dict")):
        b.add("deep_nesting", f"memory nested {depth} deep ({kind})",
              dumps({**bases["fsdp"], "memory": nested(depth, kind)}), needle=None)
    b.add("deep_nesting", "top level nested 200000 deep", "[" * 200_000 + "]" * 200_000)

    fit = [
        ("primepar rules on a data mesh",
         {**bases["fsdp"], "rules": "primepar"}, "rules"),
        ("primepar layers on a tensor mesh",
         {**bases["primepar"], "rules": "tp", "mesh": {"data": 2, "tensor": 4}}, "rules"),
        ("primepar mixed with megatron",
         replaced(bases["primepar"], ("layers", 1), {"schedule": "megatron"}), "primepar"),
        ("primepar square not square",
         {**bases["primepar"], "mesh": {"data": 1, "tp_row": 2, "tp_col": 4}}, "tp_row"),
        ("dp rules leave the tensor axis idle", {**bases["mixed"], "rules": "dp",
                                                 "layers": [{"schedule": "megatron"}] * 2},
         "tensor"),
        ("one layer too many", {**bases["mixed"], "layers": bases["mixed"]["layers"] * 2},
         "layers"),
        ("one layer too few", {**bases["mixed"], "layers": bases["mixed"]["layers"][:1]},
         "layers"),
        ("microbatches do not divide the batch", {**bases["fsdp"], "microbatches": 3},
         "microbatches"),
        ("more microbatches than sequences", {**bases["fsdp"], "microbatches": 16},
         "microbatches"),
        ("more sub-batches than rows",
         replaced(bases["mixed"], ("layers", 0, "sub_batches"), 10**9), "sub_batches"),
        ("mesh of 16 devices on 8", {**bases["mixed"], "mesh": {"data": 4, "tensor": 4}},
         "mesh"),
        ("seq_len beyond the model", {**bases["fsdp"], "seq_len": 4096}, "seq"),
    ]
    for name, doc, needle in fit:
        b.add("fit", name, dumps(doc), needle=needle)
    b.add("fit", "rules tp on a data mesh", dumps({**bases["fsdp"], "rules": "tp"}), "either")

    for value in (2, 0, "1", 1.5, True, None):
        b.add("version", f"version {value!r}", dumps({**bases["fsdp"], "version": value}),
              needle="version")
    b.add("version", "format a number", dumps({**bases["fsdp"], "format": 1}), needle="format")

    good = dumps(bases["mixed"])
    syntax = [("truncated", good[: len(good) // 2]), ("trailing comma", good[:-2] + ",}"),
              ("trailing garbage", good + "x"), ("empty file", ""), ("whitespace only", "\n \n"),
              ("single quotes", good.replace('"', "'")), ("a comment", "// plan\n" + good),
              ("NUL bytes", "\0" * 16), ("two documents", good + good)]
    for name, text in syntax:
        b.add("syntax", name, text)
    b.add("syntax", "not UTF-8", good.encode()[:40] + b"\xff\xfe" + good.encode()[40:])
    b.add("syntax", "UTF-16", good.encode("utf-16"))

    def directory(p):
        p.mkdir()
        return p

    def fifo(p):
        os.mkfifo(p)
        return p

    def link(target):
        def make(p):
            p.symlink_to(target)
            return p
        return make

    def sparse(p):
        with open(p, "wb") as f:
            f.truncate(2 * 2**30)
        return p

    def loop(p):
        p.symlink_to(p)
        return p

    for name, make in (("a directory", directory), ("a FIFO", fifo),
                       ("a link to /dev/zero", link("/dev/zero")),
                       ("a link to /dev/null", link("/dev/null")),
                       ("a missing file", lambda p: p),
                       ("a dangling link", link("/no/such/plan.json")),
                       ("a link loop", loop), ("a 2 GiB file", sparse)):
        b.add("file_kind", name, make)
    return b.cases
