"""What the always-on weight-sync check (relax/debug/sync_check.py) costs a weight sync: the real
trainer and engine of `relax <overrides>` (default: experiment=smollm2_arith_v1), synced N times
through relax.loop.sync_weights, the check on and off alternately (interleaved, so drift in a
shared machine's load hits both alike); prints the median wall time of each and of the check.

    python scripts/sync_check_cost.py [N] [overrides...]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict


def config(overrides: list[str]):
    from relax import config as relax_config
    from relax.cli import CONF_DIR, translate_args

    relax_config.register()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=translate_args(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def main(n: int, overrides: list[str]) -> None:
    import torch

    from relax import loop
    from relax.cluster import open_cluster
    from relax.debug import sync_check
    from relax.model import load_tokenizer, resolve_model_path
    from relax.rollout.spec import EngineSpec
    from relax.train.spec import TrainerSpec

    cfg = config(overrides or ["experiment=smollm2_arith_v1"])
    torch.set_num_threads(cfg.train.num_threads)
    path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(path)
    run = SimpleNamespace(cfg=cfg, plan=SimpleNamespace(partial_sync=False))
    with tempfile.TemporaryDirectory() as tmp:
        cluster = open_cluster(cfg.cluster, cfg.rollout, cfg.train, cfg.algo, cfg.parallel, Path(tmp))
        engine, trainer = cluster.build(
            EngineSpec.of(cfg.rollout, cfg.model, cfg.seed, path, [tokenizer.eos_token_id], tokenizer.pad_token_id),
            TrainerSpec.of(cfg.model, cfg.rollout, cfg.debug, cfg.seed, path, pad_token_id=tokenizer.pad_token_id))
        try:
            checks, times = [], {True: [], False: []}
            timed = sync_check.check_sync_landed

            def timing(*args):
                t0 = time.perf_counter()
                out = timed(*args)
                checks.append(time.perf_counter() - t0)
                return out

            sync_check.check_sync_landed = timing
            for i in range(2 * n + 2):
                on = i % 2 == 0
                with open_dict(cfg):
                    cfg.debug.check_weight_sync = on
                t0 = time.perf_counter()
                loop.sync_weights(run, trainer, engine, None, i)
                if i >= 2:  # the first of each: warm-up
                    times[on].append(time.perf_counter() - t0)
        finally:
            trainer.shutdown()
            engine.shutdown()
    on, off, check = (statistics.median(times[True]), statistics.median(times[False]),
                      statistics.median(checks[1:]))
    print(f"{n} syncs each, interleaved: median sync {off:.3f} s without the check, {on:.3f} s with it "
          f"(+{100 * (on - off) / off:.1f} %); the check alone {1000 * check:.1f} ms "
          f"({100 * check / off:.2f} % of the sync)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10, sys.argv[2:])
