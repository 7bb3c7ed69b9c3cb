"""The optimizer: optax AdamW, warmup + cosine schedule, global-norm clipping."""

from __future__ import annotations

import jax
import optax

from oases_jax.training.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def _decay_mask(params):
    """Decay matrices only, not norm scales or biases. Block parameters carry a leading stacked
    `layers` axis, which does not count."""

    def is_matrix(path, p):
        stacked = any(getattr(k, "key", None) == "blocks" for k in path)
        return p.ndim - stacked >= 2

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(
            lr_schedule(cfg, total_steps),
            b1=cfg.b1,
            b2=cfg.b2,
            weight_decay=cfg.weight_decay,
            mask=_decay_mask,
        ),
    )
