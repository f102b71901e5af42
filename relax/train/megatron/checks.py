"""train=megatron's start-up refusals and checkpoint layout, read by the driver before any
rank starts (relax/train/__init__.py); the layout checks that need the model run in the ranks."""

from __future__ import annotations

from relax.errors import ConfigError

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


def check_config(cfg) -> None:
    if cfg.train.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"train.attention_backend={cfg.train.attention_backend!r}: expected one "
                          f"of {', '.join(ATTENTION_BACKENDS)}")
    from relax.train.megatron.cpu_compat import check_version

    check_version()


def checkpoint_layout(cfg) -> dict:
    """Optimizer state is saved per rank: a resume needs the same parallel sizes and optimizer."""
    layout = {f"parallel.{k}": cfg.parallel[k] for k in ("tp", "pp", "vpp", "ep", "etp", "cp", "dp")}
    layout["train.use_distributed_optimizer"] = cfg.train.use_distributed_optimizer
    return layout
