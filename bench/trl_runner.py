"""The TRL side of bench/vs_trl.py: one GRPOTrainer run matched to a Relax job.

    bench/.venv-trl/bin/python bench/trl_runner.py --out result.json [relax overrides ...]

Runs inside the venv vs_trl.py builds (trl, transformers, torch CPU, hydra-core), with this
checkout on sys.path for Relax's own config, model loading, prompts and reward. It composes
the Relax config exactly as `relax <overrides>` would, maps every setting that changes the
math onto GRPOConfig (see SETTINGS below and docs/benchmarks.md) and refuses a job it cannot
match. Writes {"step_ends", "rewards", "dataset_s", "settings"} to --out: the perf_counter
time at the end of each optimizer step, the mean reward of each generation batch (one per
step), the seconds spent building the prompt dataset, and the GRPOConfig settings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from relax import config
    from relax.cli import CONF_DIR

    config.register()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def unmatched(cfg) -> list[str]:
    """Settings of the Relax job GRPOTrainer cannot reproduce here."""
    r, t, a = cfg.rollout, cfg.train, cfg.algo
    rows = r.rollout_batch_size * r.n_samples_per_prompt
    checks = [
        (t.num_steps_per_rollout == 1, f"train.num_steps_per_rollout={t.num_steps_per_rollout} (needs 1)"),
        (rows % t.micro_batch_size == 0,
         f"train.micro_batch_size={t.micro_batch_size} does not divide the {rows} samples of a rollout"),
        (not a.use_kl_loss, "algo.use_kl_loss=true (TRL's beta uses k3 with an importance weight)"),
        (cfg.parallel.world_size == 1, f"parallel={cfg.parallel.name} (needs one process)"),
        (cfg.model.dtype == "float32",
         f"model.dtype={cfg.model.dtype} (TRL's bf16 is autocast, not bf16 weights)"),
        (a.advantage_estimator in ("grpo", "reinforce"), f"algo.advantage_estimator={a.advantage_estimator}"),
    ]
    return [why for ok, why in checks if not ok]


def grpo_config(cfg, out_dir: Path):
    """GRPOConfig matched to the Relax job, and the settings as a plain dict for the report."""
    from trl import GRPOConfig

    r, t, a = cfg.rollout, cfg.train, cfg.algo
    rows = r.rollout_batch_size * r.n_samples_per_prompt
    settings = dict(
        # batch geometry: one generation batch (= one Relax rollout) per optimizer step,
        # split into micro-batches of train.micro_batch_size with gradient accumulation
        num_generations=r.n_samples_per_prompt,
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=rows // t.micro_batch_size,
        num_iterations=1,
        max_steps=r.num_rollout,
        shuffle_dataset=False,  # the dataset is already Relax's prompts in rollout order
        # sampling
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=0,
        use_vllm=False,
        # loss: PPO-clip, token mean over the whole step (Relax's normalisation), no KL
        loss_type="dapo",
        beta=0.0,
        epsilon=a.eps_clip,
        epsilon_high=a.eps_clip_high if a.eps_clip_high is not None else a.eps_clip,
        scale_rewards="group" if a.advantage_estimator == "grpo" and a.grpo_std_normalization else "none",
        entropy_coef=a.entropy_coef,
        mask_truncated_completions=False,
        # optimizer: torch AdamW, constant lr, global grad-norm clipping
        optim="adamw_torch",
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_eps,
        max_grad_norm=t.clip_grad,
        # machine: fp32 on CPU, no activation checkpointing (GRPOConfig defaults to bf16 and
        # gradient checkpointing; Relax does neither)
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=cfg.seed,
        # bookkeeping: log every step (Relax writes metrics every rollout), save nothing
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    return GRPOConfig(output_dir=str(out_dir), **settings), settings


def dataset(cfg, task, tokenizer):
    """Relax's prompts for rollouts 0..num_rollout-1, in order: TRL's batch k is rollout k."""
    from datasets import Dataset

    r = cfg.rollout
    rows = [{"prompt": p.text, "label": p.label}
            for rollout_id in range(r.num_rollout)
            for p in task.prompts(rollout_id, r.rollout_batch_size, tokenizer)]
    first = task.prompts(0, r.rollout_batch_size, tokenizer)
    # TRL tokenizes a text prompt with tokenizer(text=...); it must give Relax's prompt ids.
    got = tokenizer(text=[p.text for p in first])["input_ids"]
    if got != [p.tokens for p in first]:
        raise SystemExit("trl_runner: TRL's prompt tokenization differs from Relax's (special tokens?)")
    return Dataset.from_list(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="result JSON")
    ap.add_argument("overrides", nargs="*", help="Relax Hydra overrides of the job to match")
    args = ap.parse_args()
    cfg = compose(args.overrides)
    problems = unmatched(cfg)
    if problems:
        raise SystemExit("trl_runner: cannot match this Relax job with GRPOTrainer: " + "; ".join(problems))

    import torch
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from relax.model import load_causal_lm, load_tokenizer, resolve_model_path
    from relax.sample import Sample
    from relax.task import build_task

    torch.set_num_threads(cfg.train.num_threads)
    model_path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(model_path)
    tokenizer.padding_side = "left"  # GRPOTrainer left-pads prompts for generate()
    task = build_task(cfg.task, cfg.seed)
    t0 = time.perf_counter()
    train_dataset = dataset(cfg, task, tokenizer)
    dataset_s = time.perf_counter() - t0  # the prompt work Relax does inside its loop
    rewards: list[float] = []

    def exact_match(prompts, completions, label, **kwargs):
        """Relax's task reward on TRL's decoded completions; records each batch's mean."""
        samples = [Sample(i, i, p, [], 0, response=c, label=lab)
                   for i, (p, c, lab) in enumerate(zip(prompts, completions, label, strict=True))]
        task.score(samples, 1)
        scores = [s.reward for s in samples]
        rewards.append(sum(scores) / len(scores))
        return scores

    class StepEnds(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    step_ends = StepEnds()
    out_dir = args.out.parent / (args.out.stem + "-trainer")
    grpo_args, settings = grpo_config(cfg, out_dir)
    trainer = GRPOTrainer(
        model=load_causal_lm(model_path, cfg.model.dtype),  # Relax's own loader: fp32, sdpa
        reward_funcs=[exact_match], args=grpo_args, train_dataset=train_dataset,
        processing_class=tokenizer, callbacks=[step_ends])
    trainer.train()
    if len(rewards) != cfg.rollout.num_rollout:
        raise SystemExit(f"trl_runner: {len(rewards)} generation batches for {cfg.rollout.num_rollout} steps")
    args.out.write_text(json.dumps({
        "step_ends": step_ends.times, "rewards": rewards, "dataset_s": dataset_s,
        "settings": {**settings, "model_path": str(model_path)},
    }))


if __name__ == "__main__":
    main()
