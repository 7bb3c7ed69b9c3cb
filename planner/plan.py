"""Plans as plain JSON: what the search chose, what it predicts, and what it beat.

    {"model": "small", "cluster": "cpu-8", "global_batch": 16, "seq_len": 128,
     "mesh": {"data": 2, "tensor": 4}, "rules": "tp", "microbatches": 1,
     "layers": [{"schedule": "oases", "sub_batches": 2, "remat": "none"}, ...],
     "predicted_step_s": ..., "predicted_peak_memory_bytes": ..., "predicted_exposed_comm_s": ...,
     "memory": {...}, "baselines": {"megatron": {...}, "best_uniform": {...}},
     "search_s": ..., "cost_source": "datasheet" | "profile", "alternatives": [...],
     "verified": {...}}  # with `plan.py --verify N` only (`planner.verify`)
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import TYPE_CHECKING

from models.config import ModelConfig
from oases_jax.cli import write_atomic
from oases_jax.errors import UserError
from oases_jax.layer_plan import LayerSpec
from planner.search import SCHEDULES, Candidate, SearchResult

if TYPE_CHECKING:  # the compile path loads Flax and optax: only when a plan is compiled
    from training.config import ParallelConfig
    from training.program import CompileSpec

FORMAT = "oases-jax-plan/1"


def candidate_json(c: Candidate) -> dict:
    return {"summary": c.summary(), "mesh": c.layout.mesh(), "microbatches": c.layout.microbatches,
            "step_s": c.cost.step_s, "peak_memory_bytes": c.cost.peak_memory_bytes,
            "exposed_comm_s": c.cost.exposed_comm_s}


def plan_json(result: SearchResult, *, model: str, cfg: ModelConfig, cluster: str,
              cost_source: str, alternatives: int = 5, best: Candidate | None = None) -> dict:
    """The plan of `best` (default: the search's best) with what it predicts and beat; the
    alternatives are the next-ranked other plans."""
    best = best or result.best
    others = [c for c in result.ranked if c is not best]
    return {
        "format": FORMAT,
        "model": model,
        "model_config": dataclasses.asdict(cfg),
        "cluster": cluster,
        "global_batch": best.layout.global_batch,
        "seq_len": best.layout.seq_len,
        "mesh": best.layout.mesh(),
        "rules": best.layout.rules(),
        "microbatches": best.layout.microbatches,
        "layers": [s.to_json() for s in best.strategies],
        "predicted_step_s": best.cost.step_s,
        "predicted_peak_memory_bytes": best.cost.peak_memory_bytes,
        "predicted_exposed_comm_s": best.cost.exposed_comm_s,
        "memory": best.cost.memory,
        "baselines": {k: candidate_json(v) for k, v in result.baselines.items()},
        "search_s": result.search_s,
        "cost_source": cost_source,
        "alternatives": [candidate_json(c) for c in others[:alternatives]],
    }


@dataclasses.dataclass(frozen=True)
class Plan:
    """A loaded plan: what `scripts/train.py` and `scripts/inspect_hlo.py` need from it."""

    mesh: str  # "data=2,tensor=4"
    rules: str
    microbatches: int
    global_batch: int
    seq_len: int
    layers: tuple[LayerSpec, ...]
    raw: dict

    @property
    def schedule(self) -> str:
        """The run's schedule (`ParallelConfig.schedule`): primepar for a primepar plan, whose
        weights are stored in primepar's block layout; megatron otherwise (each layer then
        runs its own entry's schedule)."""
        return "primepar" if self.layers[0].schedule == "primepar" else "megatron"

    def parallel(self) -> ParallelConfig:
        """The parallel config a run of this plan trains and compiles with."""
        from training.config import ParallelConfig

        return ParallelConfig(mesh=self.mesh, rules=self.rules, schedule=self.schedule,
                              layers=self.layers)

    def compile_spec(self, model: ModelConfig) -> CompileSpec:
        """The whole train step this plan describes, every layer under its own strategy."""
        from training.program import CompileSpec

        return CompileSpec(model=model, parallel=self.parallel(), batch_size=self.global_batch,
                           seq_len=self.seq_len, microbatches=self.microbatches)

    def model(self, where: str = "plan") -> ModelConfig:
        """The model the plan was made for: its `model_config`, else its `model` preset."""
        from models.presets import get_preset

        if self.raw.get("model_config"):
            try:
                return ModelConfig(**self.raw["model_config"])
            except TypeError as e:
                raise UserError(f"{where}: `model_config` is not a model of this version ({e}); "
                                "plan again with scripts/plan.py, or pass --model") from None
        if self.raw.get("model"):
            return get_preset(self.raw["model"])
        raise UserError(f"{where} names no model (no `model` or `model_config`); pass --model")

    def check_model(self, cfg: ModelConfig) -> None:
        if len(self.layers) != cfg.n_layers:
            raise UserError(
                f"the plan has {len(self.layers)} layer entries but the model has "
                f"{cfg.n_layers} layers; plan again for this model with scripts/plan.py"
            )


def save(plan: dict, path: str | pathlib.Path) -> None:
    write_atomic(pathlib.Path(path), json.dumps(plan, indent=1) + "\n")


def load(path: str | pathlib.Path) -> Plan:
    """Read and validate a plan file; every problem is a one-line UserError."""
    path = pathlib.Path(path)
    if not path.exists():
        raise UserError(f"plan file {str(path)!r} does not exist; make one with scripts/plan.py "
                        "--json PLAN.json, or use --plan auto")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"plan file {str(path)!r} is not valid JSON ({e}); "
                        "write it again with scripts/plan.py") from None
    return from_json(d, str(path))


def from_json(d: dict, where: str = "plan") -> Plan:
    try:
        mesh = ",".join(f"{k}={int(v)}" for k, v in d["mesh"].items())
        layers = [_layer(entry, i, where) for i, entry in enumerate(d["layers"])]
        if not layers:
            raise UserError(f"{where}: `layers` is empty; plan again with scripts/plan.py")
        _check_primepar(layers, d, where)
        return Plan(mesh=mesh, rules=d.get("rules", "tp"), microbatches=int(d["microbatches"]),
                    global_batch=int(d["global_batch"]), seq_len=int(d["seq_len"]),
                    layers=tuple(layers), raw=d)
    except UserError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{where} is not a plan (missing or bad field {e}); "
                        "write it again with scripts/plan.py") from None


def _layer(entry: dict, i: int, where: str) -> LayerSpec:
    """One `{"schedule", "sub_batches", "remat"}` entry (`LayerSpec.to_json`) of `layers`."""
    if entry["schedule"] not in SCHEDULES:
        raise UserError(f"{where}: layer {i} has unknown schedule {entry['schedule']!r}; "
                        f"choose one of {', '.join(SCHEDULES)}")
    try:
        return LayerSpec(schedule=entry["schedule"], sub_batches=int(entry.get("sub_batches", 1)),
                         remat=entry.get("remat", "none"))
    except UserError as e:
        raise UserError(f"{where}: layer {i}: {e}; plan again with scripts/plan.py") from None


def _check_primepar(layers: list[LayerSpec], d: dict, where: str) -> None:
    """primepar shards every layer's parameters over its square, and stacked layers share one
    sharding: a plan runs primepar on every layer or on none, on a tp_row x tp_col mesh."""
    n = sum(s.schedule == "primepar" for s in layers)
    if n and n < len(layers):
        raise UserError(f"{where}: {n} of {len(layers)} layers run primepar; primepar stores "
                        "every layer's weights split over its tp_row x tp_col square, so a plan "
                        "runs it on all layers or none; plan again with scripts/plan.py")
    if n and (d.get("rules") != "primepar" or not {"tp_row", "tp_col"} <= set(d["mesh"])):
        raise UserError(f"{where}: primepar layers need rules 'primepar' and a mesh with tp_row "
                        f"and tp_col, not rules {d.get('rules')!r} on {d['mesh']}; plan again "
                        "with scripts/plan.py")
