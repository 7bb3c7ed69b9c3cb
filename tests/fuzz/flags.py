"""Hostile flags of every script (parsed and validated, never run) and hostile data paths."""

from __future__ import annotations

import os
import pathlib

import numpy as np

from tests.fuzz import targets
from tests.fuzz.harness import Case

TINY = ("--model", "tiny", "--steps", "2", "--batch-size", "8", "--seq-len", "32")
PRIMEPAR_MESH = "data=2,tp_row=2,tp_col=2"


def flag_cases(tmp: pathlib.Path) -> list[Case]:
    a_file = tmp / "a-file"
    a_file.write_text("x")
    a_dir = tmp / "a-dir"
    a_dir.mkdir()
    report = tmp / "report.json"
    report.write_text('{"schedule": "megatron"}')
    good = tmp / "good.json"
    good.write_text('{"schedule": "megatron", "target": "local", "collectives": [{"kind": '
                    '"all-reduce", "axes": ["tensor"], "count": 2}], "peak_memory_bytes": 1e6, '
                    '"collective_bytes": 4096, "simulated_step_s": 0.01, "exposed_comm_s": 0}')
    cases: list[Case] = []

    def add(script: str, category: str, args: tuple, expect="reject", needle=None,
            shown: tuple | None = None) -> None:
        run = getattr(targets, script)
        name = f"{script} {' '.join(shown if shown is not None else args)}"
        cases.append(Case(f"flags:{category}", name, lambda: run(*args), expect, needle))

    def train(category, *args, expect="reject", needle=None):
        add("train", category, (*TINY, "--out-dir", str(tmp / f"run{len(cases)}"), *args),
            expect, needle, shown=args)

    train("valid", expect="accept")
    train("valid", "--clip-norm", "0.5", "--weight-decay", "0", "--keep", "1", expect="accept")
    train("valid", "--schedule", "primepar", "--mesh", PRIMEPAR_MESH, expect="accept")
    train("valid", "--coordinator", "10.0.0.1:1234", "--num-processes", "2", "--process-id",
          "0", expect="either")
    train("valid", "--coordinator", "[::1]:1234", expect="either")
    for key, value in (("head_dim", "0"), ("n_kv_heads", "0"), ("d_ff", "-1"),
                       ("vocab_multiple", "0"), ("n_layers", "0"), ("max_seq_len", "-5"),
                       ("norm_eps", "0"), ("norm_eps", "nan"), ("rope_theta", "-1"),
                       ("rope_theta", "inf"), ("vocab_size", "1000000000000"),
                       ("d_model", "10000000000"), ("n_heads", "0"), ("head_dim", "-64")):
        train("model_set", "--model-set", f"{key}={value}", needle=key)
    for flag, value in (("--clip-norm", "-1"), ("--clip-norm", "nan"), ("--clip-norm", "0"),
                        ("--weight-decay", "-5"), ("--weight-decay", "inf"), ("--keep", "0"),
                        ("--keep", "-1"), ("--stop-after", "-1"), ("--stop-after", "0"),
                        ("--peak-tflops", "-1"), ("--peak-tflops", "0"), ("--lr", "nan"),
                        ("--lr", "inf"), ("--lr", "0"), ("--warmup-steps", "-1"),
                        ("--seed", "-1"), ("--seed", str(2**70)), ("--eval-batches", "-1"),
                        ("--log-every", "0"), ("--ckpt-every", "0"), ("--sub-batches", "0"),
                        ("--batch-size", str(10**12)), ("--seq-len", "0"), ("--steps", "-3"),
                        ("--microbatches", "0"), ("--batch-size", "0")):
        train("range", flag, value, needle=flag)
    train("schedule_mesh", "--schedule", "primepar", "--mesh", "data=8", needle="primepar")
    train("schedule_mesh", "--schedule", "primepar", "--mesh", "data=2,tensor=4",
          needle="primepar")
    train("schedule_mesh", "--schedule", "primepar", "--mesh", "data=2,tp_row=4", needle="tp_col")
    train("schedule_mesh", "--rules", "primepar", "--mesh", "data=8", needle="primepar")
    train("schedule_mesh", "--rules", "nope", needle="nope")
    for flag, path in (("--out-dir", a_file / "run"), ("--out-dir", a_file),
                       ("--metrics-out", a_dir), ("--metrics-out", a_file / "m.jsonl"),
                       ("--ckpt-dir", a_file), ("--plan", a_dir), ("--plan", tmp / "none.json")):
        train("paths", flag, str(path), needle=flag if flag != "--plan" else str(path))
    for value in ("notaport", "host:", ":1234", "host:0", "host:65536", "host:12x",
                  "a:b:c", ""):
        train("coordinator", "--coordinator", value, "--num-processes", "2", "--process-id",
              "0", needle="--coordinator")
    train("data", "--data", "", needle="--data")

    plan = ("--model", "tiny", "--global-batch", "8", "--seq-len", "32")
    add("plan", "valid", plan, "accept")
    for flag, value in (("--global-batch", "0"), ("--global-batch", "-1"),
                        ("--global-batch", str(10**12)), ("--seq-len", "0"),
                        ("--seq-len", str(10**9)), ("--memory-fraction", "0"),
                        ("--memory-fraction", "1.5"), ("--memory-fraction", "nan"),
                        ("--memory-fraction", "-0.1"), ("--verify", "-1"), ("--top", "-1"),
                        ("--json", str(a_dir)), ("--json", str(a_file / "plan.json")),
                        ("--save-cluster", str(a_dir)), ("--profile", str(a_dir)),
                        ("--schedules", ""), ("--schedules", "warp"), ("--cluster", "h100:0"),
                        ("--cluster", str(a_dir)), ("--cluster", str(tmp / "none.json"))):
        args = plan + (flag, value) + (("--cost-source", "profile") if flag == "--profile"
                                       else ())
        add("plan", "range", args, needle=value if flag in ("--profile", "--cluster") else flag,
            shown=(flag, value))

    add("inspect_hlo", "valid", ("--model", "tiny", "--mesh", "data=2,tensor=4"), "accept")
    add("inspect_hlo", "valid", ("--diff", f"{good},{good}"), "accept")
    for args, needle in ((("--diff", f"{good},{tmp / 'missing.json'}"), "missing.json"),
                         (("--diff", f"{report},{good}"), "report.json"),
                         (("--diff", f"{a_dir}/x.json,{good}"), "x.json"),
                         (("--diff", "megatron"), "--diff"),
                         (("--batch-size", "0"), "--batch-size"),
                         (("--seq-len", "-1"), "--seq-len"), (("--sub-batches", "0"), "sub"),
                         (("--json", str(a_dir)), "--json"),
                         (("--timeline", str(a_file / "t.png")), "--timeline"),
                         (("--plan", str(a_dir)), str(a_dir)),
                         (("--schedule", "primepar", "--mesh", "data=8"), "primepar"),
                         (("--seq-len", "4096"), "max_seq_len")):
        add("inspect_hlo", "range", ("--model", "tiny", *args), needle=needle)

    add("bench", "valid", ("--model", "tiny", "--seq-len", "32", "--batch-size", "8"), "accept")
    for flag, value in (("--batch-size", "0"), ("--warmup", "-1"), ("--rounds", "0"),
                        ("--steps-per-round", "0"), ("--seq-len", "0"), ("--json", str(a_dir)),
                        ("--data", ""), ("--data", str(a_dir / "none.txt")), ("--seed", "-1")):
        add("bench", "range", ("--model", "tiny", flag, value),
            needle="none.txt" if value.endswith("none.txt") else flag)

    out = ("--out", str(tmp / "prof.json"))
    add("calibrate", "valid", ("--quick", *out), "accept")
    for flag, value in (("--tensor", "0"), ("--tokens", "0"), ("--repeats", "0"),
                        ("--warmup", "-1"), ("--min-program-ms", "0"),
                        ("--min-program-ms", "nan"), ("--out", str(a_dir)),
                        ("--out", str(a_file / "p.json")), ("--kinds", "gossip"),
                        ("--dtypes", "int7"), ("--axis-sizes", "16"), ("--model", "nope")):
        add("calibrate", "range", ("--quick", *out, flag, value),
            needle=value if flag in ("--kinds", "--dtypes", "--model") else flag,
            shown=(flag, value))

    add("memory_table", "valid", ("--targets", "h100:4", "--models", "gpt2-1.5b"), "accept")
    for flag, value in (("--targets", "h100:8"), ("--targets", "tpu:8"), ("--models", "nope")):
        add("memory_table", "range", (flag, value), needle=value, shown=(flag, value))
    return cases


def data_cases(tmp: pathlib.Path) -> list[Case]:
    """Paths given to `--data`, loaded as training loads them (corpus, then its batches)."""
    from oases_jax.training.data import BatchSampler, load_corpus

    def load(spec: str):
        def run():
            corpus = load_corpus(spec, vocab_size=256)
            for i, tokens in enumerate((corpus.train, corpus.val)):
                BatchSampler(tokens=tokens, seq_len=32, batch_size=8, seed=0, stream=i)
        return run

    d = tmp / "data"
    d.mkdir()
    text = d / "a.txt"
    text.write_bytes(b"hello world " * 200)
    tokens = (np.arange(4000) % 250).astype(np.uint16)
    tokens.tofile(d / "tokens.bin")
    (d / "empty.txt").write_bytes(b"")
    (d / "empty.bin").write_bytes(b"")
    (d / "odd.bin").write_bytes(b"abc")
    (d / "big-ids.bin").write_bytes(np.array([1, 60000] * 100, dtype=np.uint16).tobytes())
    os.mkfifo(d / "fifo.txt")
    os.mkfifo(d / "fifo.bin")
    (d / "zero.txt").symlink_to("/dev/zero")

    def split(name: str, train: bytes | None, val: bytes | None, *, val_kind="file"):
        root = d / name
        root.mkdir()
        if train is not None:
            (root / "train.bin").write_bytes(train)
        if val_kind == "fifo":
            os.mkfifo(root / "val.bin")
        elif val_kind == "dir":
            (root / "val.bin").mkdir()
        elif val is not None:
            (root / "val.bin").write_bytes(val)
        return root

    tok = tokens.tobytes()
    texts = d / "texts"
    texts.mkdir()
    (texts / "a.txt").write_bytes(b"x" * 4000)
    (texts / "b.txt").write_bytes(b"y" * 4000)
    fifo_dir = d / "fifo-dir"
    fifo_dir.mkdir()
    (fifo_dir / "a.txt").write_bytes(b"x" * 4000)
    os.mkfifo(fifo_dir / "b.txt")

    specs = [
        ("valid", str(text), "accept", None), ("valid", str(d / "tokens.bin"), "accept", None),
        ("valid", str(split("split", tok, tok)), "accept", None),
        ("valid", str(texts), "accept", None), ("valid", "stdlib", "accept", None),
        ("empty", "", "reject", "data"), ("empty", str(d / "empty.txt"), "reject", "empty"),
        ("empty", str(d / "empty.bin"), "reject", "empty"),
        ("empty", str(split("empty-val", tok, b"")), "reject", "val.bin"),
        ("empty", str(split("empty-train", b"", tok)), "reject", "train.bin"),
        ("kind", str(d / "fifo.txt"), "reject", "fifo.txt"),
        ("kind", str(d / "fifo.bin"), "reject", "fifo.bin"),
        ("kind", "/dev/zero", "reject", "/dev/zero"), ("kind", "/dev/null", "reject", "/dev/null"),
        ("kind", str(d / "zero.txt"), "reject", "zero.txt"),
        ("kind", str(split("fifo-val", tok, None, val_kind="fifo")), "reject", "val.bin"),
        ("kind", str(split("dir-val", tok, None, val_kind="dir")), "reject", "val.bin"),
        ("kind", str(fifo_dir), "reject", "b.txt"),
        ("content", str(d / "odd.bin"), "reject", "odd.bin"),
        ("content", str(d / "big-ids.bin"), "reject", "vocab_size"),
        ("content", str(split("no-val", tok, None)), "reject", "val.bin"),
        ("missing", str(d / "none.txt"), "reject", "none.txt"),
        ("missing", str(d / "a.txt" / "below"), "reject", "below"),
    ]
    return [Case(f"data:{cat}", spec or '""', load(spec), expect, needle)
            for cat, spec, expect, needle in specs]
