"""Our simulator's costs as XLA's scheduling profile: the profile's text by hand, a GPU program
compiled again under it (`schedule_costs="simulated"`), and the flags that refuse it."""

import pytest

from oases_jax.models.presets import get_preset
from oases_jax.targets import get_target, has_gpu_aot
from oases_jax.tools.analysis.program import is_async_start
from oases_jax.tools.analysis.schedule_profile import instruction_costs, profile_text
from oases_jax.tools.inspection import inspect_program
from oases_jax.training.config import ParallelConfig
from oases_jax.training.program import SCHEDULE_PROFILE_OPTION, CompileSpec
from tests.scriptrun import run_script


def test_profile_text_by_hand():
    text = profile_text({"fusion.3": 5e-6, "all-gather-start.1": 30.8e-6})
    assert text.splitlines() == [
        'costs { name: "all-gather-start.1" cost_us: 30.8000 }',
        'costs { name: "all-gather.1" cost_us: 30.8000 }',  # the collective before it is async
        'costs { name: "fusion.3" cost_us: 5.0000 }']


@pytest.mark.gpu_aot
@pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")
def test_simulated_costs_compile_the_program_again_under_its_own_profile(tmp_path):
    """The second compile reads the profile of the first: every collective it starts is priced
    there at our alpha-beta time, and the report says whose costs ordered it."""
    spec = CompileSpec(model=get_preset("small").replace(dtype="bfloat16"), batch_size=8,
                       seq_len=256, layer=True,
                       parallel=ParallelConfig(mesh="tensor=8", schedule="oases_sp"))
    target = get_target("h100:8")
    path = tmp_path / "profile.pbtxt"
    ins = inspect_program(spec, target, schedule_costs="simulated", write_profile=str(path))
    r = ins.report()
    assert r["schedule_costs"] == "simulated" and r["xla_scheduled_step_s"] > 0
    assert r["compiler_options"][SCHEDULE_PROFILE_OPTION]
    text = path.read_text()
    first = inspect_program(spec, target)  # the program the profile was written from
    costs = instruction_costs(first.program, target.cluster)
    assert text == profile_text(costs)
    starts = [i.name for c in ins.program.module.computations.values() for i in c.instrs
              if is_async_start(i)]
    assert starts and sum(f'name: "{n}"' in text for n in starts) >= len(starts) - 1
    assert all(costs[n] > 0 for n in starts if n in costs)


@pytest.mark.parametrize("script, args, message", [
    ("inspect_hlo.py", ["--schedule-costs", "simulated"], "give a GPU --target"),
    ("inspect_hlo.py", ["--target", "h100:8", "--schedule-profile", "/nonexistent.pbtxt"],
     "--schedule-profile '/nonexistent.pbtxt' does not exist"),
    ("inspect_hlo.py", ["--target", "h100:8", "--compare", "megatron,oases",
                        "--write-schedule-profile", "p.pbtxt"], "the profile of one program"),
    ("train.py", ["--model", "tiny", "--steps", "1", "--schedule-profile", "/nonexistent"],
     "write one with inspect_hlo.py --write-schedule-profile"),
])
def test_schedule_profile_flags_refuse_bad_input(script, args, message):
    r = run_script(script, *args, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1


def test_train_compiles_with_a_schedule_profile(tmp_path):
    """On CPU the profile orders nothing, but the step compiles and trains with the option."""
    profile = tmp_path / "p.pbtxt"
    profile.write_text(profile_text({"fusion.1": 1e-6}))
    r = run_script("train.py", "--model", "tiny", "--steps", "2", "--seq-len", "32",
                   "--batch-size", "8", "--eval-batches", "0",
                   "--out-dir", str(tmp_path / "run"), "--schedule-profile", str(profile),
                   timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert SCHEDULE_PROFILE_OPTION in r.stdout
