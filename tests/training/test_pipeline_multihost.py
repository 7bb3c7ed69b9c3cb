"""A pipeline whose stage axis crosses processes: two processes of 4 CPU devices on localhost,
mesh stage=2,data=2,tensor=2 with stage 0 on process 0's devices and stage 1 on process 1's,
train 1F1B for a few steps like one process of 8 devices does (the stage-to-stage permutes
then go between processes, over gloo)."""

import json
import sys

import numpy as np
import pytest

from oases_jax.models import get_preset
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.training import ParallelConfig, TrainConfig, train
from tests.training.test_multihost import ROOT, cli_env, free_port, run_processes

MESH, STEPS = "stage=2,data=2,tensor=2", 3
# Each child joins the cluster, checks that the stage axis crosses the processes, trains, and
# (process 0) writes its losses.
CHILD = """
import json, sys
import jax
port, pid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_num_cpu_devices", 4)
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from tests.training.test_pipeline_multihost import config
from oases_jax.mesh import make_mesh
from oases_jax.training import train
cfg = config()
mesh = make_mesh(cfg.parallel.mesh)
owners = [sorted({d.process_index for d in mesh.devices[s].flat}) for s in range(2)]
result = train(cfg)
if pid == 0:
    with open(out, "w") as f:
        json.dump({"owners": owners, "losses": result.losses}, f)
"""


def config() -> TrainConfig:
    return TrainConfig(model=get_preset("tiny"), steps=STEPS, batch_size=8, microbatches=4,
                       seq_len=32, data=str(ROOT / "README.md"), log_every=1, eval_batches=0,
                       progress=False,
                       parallel=ParallelConfig(mesh=MESH, rules="tp", schedule="megatron",
                                               pipeline=PipelineConfig(schedule="1f1b")))


@pytest.mark.slow
def test_stage_axis_across_processes_trains_like_one_process(tmp_path, jax_cache):
    port, out = free_port(), tmp_path / "losses.json"
    done = run_processes([[sys.executable, "-c", CHILD, str(port), str(i), str(out)]
                          for i in range(2)], tmp_path,
                         env={**cli_env(), "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    for code, _, stderr in done:
        assert code == 0, stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["owners"] == [[0], [1]]  # each stage on one process: every permute crosses
    losses = {int(k): v for k, v in got["losses"].items()}
    reference = train(config()).losses  # one process, 8 devices, the same mesh
    assert sorted(losses) == sorted(reference) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([losses[s] for s in reference], list(reference.values()),
                               rtol=1e-5, atol=0)
