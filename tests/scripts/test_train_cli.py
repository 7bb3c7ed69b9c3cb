"""scripts/train.py from the command line: the quickstart path and every bad input.

Each bad input must give one line on stderr naming the value and the fix, a non-zero exit, and no
traceback.
"""

import json

import pytest

from tests.scriptrun import run_script


def run_train(*args, cwd=None, timeout=300):
    return run_script("train.py", "--no-progress", *args, timeout=timeout, cwd=cwd)


def assert_one_line_error(proc, *needles, code=2):
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


TINY = ("--model", "tiny", "--steps", "2", "--batch-size", "8", "--seq-len", "32")


@pytest.mark.parametrize(
    "args, needles",
    [
        (("--model", "gpt-9000"), ("gpt-9000", "choose one of")),
        (("--bogus-flag", "1"), ("--bogus-flag", "--help")),
        (("--steps", "ten"), ("ten",)),
        (("--mesh", "data=3,tensor=4"), ("data=3,tensor=4", "12 devices", "8")),
        (("--mesh", "data=-1,tensor=-1"), ("more than one -1",)),
        (("--mesh", "data=2,tensr=4"), ("tensr", "tensor")),
        (
            ("--mesh", "data=1,tensor=8", "--model-set", "n_heads=4", "--model-set", "d_model=64"),
            ("kv_heads=4", "tensor=8"),
        ),
        (("--batch-size", "6", "--mesh", "data=4,tensor=2"), ("batch", "6", "data")),
        (("--data", "/no/such/file.txt"), ("/no/such/file.txt", "does not exist")),
        (("--schedule", "warp-speed"), ("warp-speed", "megatron")),
        (("--rules", "zero9"), ("zero9", "tp_sp")),
        (("--model-set", "n_layers=two"), ("n_layers", "two")),
        (("--model-set", "depth=3"), ("depth",)),
        (("--seq-len", "4096"), ("4096", "max_seq_len")),
        (("--resume",), ("--resume", "no checkpoint", "drop --resume")),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, needles):
    proc = run_train(*TINY, "--out-dir", str(tmp_path / "run"), *args)
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "run" / "ckpt").exists() or not any(
        (tmp_path / "run" / "ckpt").iterdir()
    )


def test_tiny_run_writes_checkpoint_and_metrics(tmp_path):
    proc = run_train(
        "--model",
        "tiny",
        "--steps",
        "6",
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        "--log-every",
        "2",
        "--eval-every",
        "3",
        "--out-dir",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert all(r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0 for r in train)
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert (tmp_path / "run" / "ckpt" / "6").is_dir()
    assert "loss" in proc.stdout and "tokens/s" in proc.stdout


@pytest.mark.slow
def test_a_pipelined_plan_trains(tmp_path):
    """`train.py --plan` runs a 3D plan's stage section (schedule, stage layers, per-stage
    recompute), not just its mesh."""
    plan = {"format": "oases-jax-plan/1", "version": 1, "model": "tiny", "global_batch": 8,
            "seq_len": 32, "mesh": {"data": 2, "stage": 2, "tensor": 2}, "rules": "tp",
            "microbatches": 4, "layers": [{"schedule": "megatron"}] * 2,
            "pipeline": {"schedule": "1f1b", "stages": 2, "stage_layers": [1, 1],
                         "remat_ratios": ["1", "0"], "virtual_stages": 1}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    proc = run_train("--model", "tiny", "--plan", str(path), "--steps", "3", "--out-dir",
                     str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss" in proc.stdout
    # The stage section is what runs: Merak's schedule needs more than one micro-batch.
    merak = {**plan, "microbatches": 1, "pipeline": {**plan["pipeline"], "schedule": "merak"}}
    path.write_text(json.dumps(merak))
    assert_one_line_error(run_train("--model", "tiny", "--plan", str(path), "--steps", "1",
                                    "--out-dir", str(tmp_path / "merak")), "merak")


def test_auto_plan_on_cpu_counts_the_host_memory_its_devices_share(tmp_path):
    """GPT-2 1.5B at 4096 x 128 tokens on 8 CPU devices: the leanest plan needs tens of GiB per
    device, far past a host's memory shared 8 ways; refused in one line before any compile."""
    import time

    t0 = time.perf_counter()
    proc = run_train("--model", "gpt2-1.5b", "--plan", "auto", "--batch-size", "4096",
                     "--out-dir", str(tmp_path / "run"), timeout=60)
    took = time.perf_counter() - t0
    assert_one_line_error(proc, "no plan fits", "the 8 CPU devices sharing this host's")
    assert took < 30, took  # the search takes about a second; start-up is the rest
    assert not (tmp_path / "run").exists()


def test_sigint_during_start_up_is_one_line(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from tests.scriptrun import ROOT

    env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "--no-progress", "--model", "small",
         "--out-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lock = tmp_path / "run" / ".ckpt.lock"  # taken just before the restore and the compile
    deadline = time.monotonic() + 120
    while not lock.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("train.py:")]
    assert lines == ["train.py: interrupted (SIGINT) before it finished; nothing was written "
                     "since the last complete output"], err[-3000:]
