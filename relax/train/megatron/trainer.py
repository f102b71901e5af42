"""The Megatron-core trainer (train=megatron): GPTModel built from the HF checkpoint.

Same RL math and batching as train=torch (relax.train.common); the machinery is
Megatron's: `parallel_state` for TP/PP/VPP/CP/EP/DP groups (read once into a `Layout`,
relax/train/megatron/layout.py), GPTModel chunks (model.py) holding this rank's shard of
the HF weights (weights.py), `get_forward_backward_func` schedules for the reference/old
log-probs (forward only) and the training step, Megatron DDP with the distributed
optimizer, and its grad clipping (`train/grad_norm` comes from Megatron).
"""

from __future__ import annotations

import contextlib
import math
import operator
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from relax.algo import masked_sum, sequence_loss_scales
from relax.model import families, save_hf_dir
from relax.sample import Sample, log_prob_temperature, require_routed_experts
from relax.train import batch_invariance, common
from relax.train.common import MicroBatch
from relax.train.megatron import checks, cpu_compat, layer_dump
from relax.train.megatron.context_parallel import cp_full, cp_local
from relax.train.megatron.layout import init_layout
from relax.train.megatron.model import (GPU, build_chunks, deterministic_mode, transformer_config,
                                        wrap_for_training)
from relax.train.megatron.routing import Routing as MoERouting
from relax.train.megatron.weights import Weights, load_optimizer_state, save_optimizer_state
from relax.train.parallel import dp_all_reduce, peak_memory_mb
from relax.train.profile import phase, profiled
from relax.train.spec import TrainerSpec
from relax.train.weight_sync import DistributedWeightSync


def _sum(t: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


class MegatronTrainer(DistributedWeightSync):
    """Trainer interface (relax/train/__init__.py): train / named_weights / save_checkpoint /
    load_checkpoint / shutdown."""
    check_config = staticmethod(checks.check_config)
    checkpoint_layout = staticmethod(checks.checkpoint_layout)
    replays_routing = True  # algo.routing_replay: Megatron-core's RouterReplay (routing.py)
    rank_imports = ("relax.train.megatron.rank_imports",)  # see relax/train/__init__.py

    def __init__(self, train, algo, parallel, spec: TrainerSpec, rank: int = 0, world_size: int = 1):
        warnings.filterwarnings("ignore", module=r"megatron\.")  # "Apex/TE not installed" & co
        warnings.filterwarnings("ignore", message=".*(deprecated|non-leaf Tensor).*")
        if not GPU:
            cpu_compat.apply()
        self.train_cfg, self.algo, self.parallel, self.spec = train, algo, parallel, spec
        self.pad_id, self.save_train_data = spec.pad_token_id, spec.save_train_data
        self.hf_config = AutoConfig.from_pretrained(spec.model_path)
        if GPU and train.deterministic:
            deterministic_mode()
        torch.set_num_threads(train.num_threads)
        self.temperature = log_prob_temperature(spec.temperature)
        self.layout = init_layout(parallel, spec.seed, rank, world_size)
        self.config = transformer_config(self.hf_config, self.layout, train, spec.dtype)
        self.config.moe_enable_routing_replay = bool(algo.routing_replay)
        if algo.routing_replay:  # (its routers register in a process-wide list: only this trainer's)
            # optional: megatron-core (relax[megatron])
            from megatron.core.transformer.moe.router_replay import RouterReplay

            RouterReplay.clear_global_router_replay_instances()
        self.weights = Weights(self.hf_config, self.layout)
        self.ref = self.weights.load(self._build(), spec.ref_model_path or spec.model_path)
        actor = self.weights.load(self._build(), spec.model_path)  # the actor's passthrough is kept
        self.moe_routing = MoERouting([self.ref, actor], self.layout, self.hf_config.num_hidden_layers,
                                  self.hf_config.num_experts_per_tok, algo.routing_replay) \
            if families.num_experts(self.hf_config.to_dict()) else None
        common.nudge_ulps([p for chunk in actor for p in chunk.parameters()], parallel.noise_ulp,
                          spec.seed)
        self.actor, self.optimizer = wrap_for_training(actor, self.config, train, spec.dtype)
        self.skipped_steps = 0
        self.first_step = True  # nothing trained or loaded yet: the guide's first-step checks apply

    def _build(self) -> list:
        return build_chunks(self.config, self.hf_config, self.layout)

    # -- the algorithm ---------------------------------------------------------------------
    @profiled
    def train(self, rollout_id: int, samples: list[Sample]) -> dict:
        t, layout = self.train_cfg, self.layout
        advantages = common.advantages_of(samples, self.algo)
        steps = common.shard_steps(samples, advantages, t.num_steps_per_rollout, layout.dp_size,
                                   layout.dp_rank, t.micro_batch_size, self.pad_id,
                                   fixed_shape=True, length_multiple=layout.length_multiple,
                                   loss_agg_mode=self.algo.loss_agg_mode,
                                   horizon=self.spec.max_new_tokens)
        micro_batches = [mb for step in steps for mb in step]
        last = layout.is_last_stage  # computes the logits, hence every result

        ref, old = common.forward_passes(self.train_cfg, self.algo, rollout_id, self.first_step,
                                         self.save_train_data)
        if self.algo.routing_replay == "rollout":
            require_routed_experts(samples, f"rollout {rollout_id}")
        ref_out = old_out = None
        if ref:
            with phase("step:reference"):
                ref_out = self._forward_log_probs(self.ref, micro_batches, "ref")
        if old:
            with phase("step:old_log_probs"):
                old_out = self._forward_log_probs(self.actor, micro_batches, "old")
        if last:
            for k, mb in enumerate(micro_batches):
                if ref:
                    mb.ref_log_probs = ref_out[k][0]
                if old:
                    mb.old_log_probs, mb.entropy = old_out[k]
            if old:  # (without this pass, each training forward attaches its own)
                common.attach_is_weights(micro_batches, self.algo)
        invariance = batch_invariance.check(
            self.spec.check_batch_invariance and self.first_step, micro_batches,
            lambda mbs: [lp for lp, _ in self._forward_log_probs(self.actor, mbs)], self.pad_id, layout,
            holds_results=last, length_multiple=layout.length_multiple)
        log = common.TrainLog(layout, ref)
        for step, step_mbs in enumerate(steps):
            t0 = time.perf_counter()
            for chunk in self.actor:
                chunk.train()
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            with phase("step:forward_backward"):
                losses = self._schedule(self.actor, step_mbs, self._loss, forward_only=False, forward="train")
            with phase("step:optimizer"):
                # per-position sums were taken on CP-local chunks: sum over CP ranks too
                sums = _sum(sum(losses), layout.dp_cp_group) if last else None
                stepped, grad_norm = self._optimizer_step(sums is None or bool(torch.isfinite(sums[0])))
                if stepped:  # parallel.step_noise_ulp (a noise twin): every step's result nudged
                    common.step_noise(self._main_params(), self.parallel.step_noise_ulp, self.spec.seed,
                                      rollout_id * t.num_steps_per_rollout + step)
            peak = peak_memory_mb()  # a collective over every rank
            self.skipped_steps += not stepped
            if last:
                num_tokens = dp_all_reduce(sum(mb.mask.sum() for mb in step_mbs), layout)
                log.step(step, step_mbs, [x[0] for x in losses], sums, num_tokens, grad_norm, stepped,
                         self.optimizer.param_groups[0]["lr"], t0, peak, self.skipped_steps)
            if not stepped and t.on_nonfinite == "error":
                break
        routed = self.moe_routing.rollout_sums() if self.moe_routing else (None, None)  # (a collective)
        result = None
        if last:
            result = log.result(micro_batches, self.first_step, self.save_train_data, rollout_id, samples,
                                advantages, self.algo.kl_loss_type, routed)
            result["steps"][0].update(invariance)
        self.first_step = False
        return self._from_last_stage(result)

    def dump_layers(self, path: str, rollout_id: int, samples: list[Sample], indices: list[int],
                    manifest: dict) -> None:
        """debug.dump_layers (relax/train/layer_dump.py), as train=torch records it: samples
        `indices` as one micro-batch through the training schedule, before the rollout's first
        step, and through the reference's forward. Every DP rank runs the same micro-batch; the
        schedule's finalize_model_grads sums the DP and CP ranks' gradients and divides by their
        summed token count, so `main_grad` is that micro-batch's gradient (train=torch's g / N).
        Rank 0 writes."""
        layout, last = self.layout, self.layout.is_last_stage
        advantages = common.advantages_of(samples, self.algo)
        chosen = [samples[i] for i in indices]
        scales = dict(zip(indices, sequence_loss_scales([sum(s.loss_mask) for s in chosen],
                                                        self.algo.loss_agg_mode,
                                                        self.spec.max_new_tokens)))
        length = -(-max(len(s.tokens) for s in chosen) // layout.length_multiple) * layout.length_multiple
        mb = common.make_micro_batch(chosen, advantages, self.pad_id, length=length, scales=scales)
        # the interleaved schedule (vpp > 1) needs >= pp micro-batches: the same one pp times has
        # the same gradient (finalize_model_grads divides by the summed token count) and outputs
        mbs = [mb] * (layout.pp_size if layout.vpp > 1 else 1)
        with layer_dump.recording(self.ref) as ref_outputs:
            ref = self._forward_log_probs(self.ref, mbs)
        if last:
            mb.ref_log_probs = ref[0][0]
        params = self.named_weights()
        for chunk in self.actor:
            chunk.train()
            chunk.zero_grad_buffer()
        with layer_dump.recording(self.actor) as outputs:
            self._schedule(self.actor, mbs, self._loss, forward_only=False, force_all_reduce=True)
        grads = self.weights.gather(self.actor, read=operator.attrgetter("main_grad"))
        for chunk in self.actor:  # the first training step starts from zero all the same
            chunk.zero_grad_buffer()
        save = partial(layer_dump.save_on_rank0, path, rollout_id, manifest=manifest, indices=indices,
                       lengths=[len(s.tokens) for s in chosen], layout=layout,
                       num_layers=self.hf_config.num_hidden_layers)
        # the last stage's `_loss` left this forward's log-probs in mb.old_log_probs, whole sequences
        save("train", outputs, common.per_sample(mb.old_log_probs, mb) if last else None, grads=grads,
             params=params)
        save("ref", ref_outputs, common.per_sample(mb.ref_log_probs, mb) if last else None)

    def _optimizers(self) -> list:
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    def _main_params(self) -> list[torch.Tensor]:
        """The weights the optimizer steps (fp32: views of the model's own)."""
        return [p for inner in self._optimizers() for p in inner.get_parameters()]

    def _optimizer_step(self, loss_finite: bool) -> tuple[bool, float]:
        """Megatron's optimizer.step(), split so that a non-finite loss (known on the last
        stage) or grad norm skips the update on every rank: with fp32 params Megatron has
        no inf check, and a NaN norm fails its `clip_coeff < 1` test and steps anyway."""
        # optional: megatron-core (relax[megatron])
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        bad = torch.tensor(float(found_inf or not loss_finite or not math.isfinite(grad_norm)))
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            return False, grad_norm
        for inner in self._optimizers():
            params = inner.get_parameters()
            if inner.config.clip_grad > 0 and params:
                clip_grad_by_total_norm_fp32(params, inner.config.clip_grad, grad_norm,
                                             inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return self.optimizer.step_with_ready_grads(), grad_norm

    def _seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums of a CP-local [b, t] tensor over the whole sequence (no autograd)."""
        total = x.sum(-1)
        if self.layout.cp_size > 1:
            dist.all_reduce(total, group=self.layout.cp_group)
        return total

    def _log_probs(self, logits: torch.Tensor, mb: MicroBatch):
        """Megatron's output layer covers every position; the softmax only the trained ones
        (under CP a rank's positions are not contiguous: all of them)."""
        first = common.first_trained_position(mb) if self.layout.cp_size == 1 else 0
        return common.trained_log_probs(logits, mb, first, self.temperature, self.algo.entropy_coef != 0)

    def _loss(self, mb: MicroBatch, whole: MicroBatch, logits: torch.Tensor):
        """`mb`: this CP rank's part of the micro-batch `whole` (the same object without CP)."""
        log_probs, entropy = self._log_probs(logits, mb)
        loss, sums = common.objective(log_probs, entropy, mb, self.algo, self._seq_sum)
        if whole.old_log_probs is None:  # this forward's log-probs were the old ones: whole sequences
            whole.old_log_probs, whole.entropy = cp_full(mb.old_log_probs, self.layout), cp_full(
                mb.entropy, self.layout)
        # Megatron divides by the step's token count (all-reduced over DP): with the loss
        # weights, the algo.loss_agg_mode aggregate.
        return masked_sum(loss, mb.loss_weights), mb.mask.sum().int(), sums

    # -- forward/backward through Megatron's schedules ------------------------------------
    def _schedule(self, chunks, micro_batches: list[MicroBatch], loss_func, forward_only: bool,
                  force_all_reduce: bool = False, forward: str | None = None):
        """`force_all_reduce`: every DP rank's grad buffer ends up whole (not reduce-scattered
        for the distributed optimizer). `forward` ("ref", "old", "train"): the pass, for MoE
        routing (None: not measured, not replayed)."""
        # optional: megatron-core (relax[megatron])
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            whole = next(data_iterator)
            mb, positions = cp_local(whole, self.layout)
            with self.moe_routing.forward(whole, positions, forward) if self.moe_routing and forward \
                    else contextlib.nullcontext():
                output = model(input_ids=mb.tokens, position_ids=positions, attention_mask=None)
            return output, partial(loss_func, mb, whole)

        vpp = len(chunks)
        data = [iter(micro_batches) for _ in range(vpp)] if vpp > 1 else iter(micro_batches)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data,
            model=chunks if vpp > 1 else chunks[0], num_microbatches=len(micro_batches),
            seq_length=micro_batches[0].tokens.shape[1],
            micro_batch_size=micro_batches[0].tokens.shape[0],
            forward_only=forward_only, collect_non_loss_data=forward_only, force_all_reduce=force_all_reduce)

    def _forward_log_probs(self, chunks, micro_batches: list[MicroBatch], forward: str | None = None):
        """Per-position log-probs and entropy of every micro-batch (last pipeline stage only)."""
        def collect(mb, whole, logits, non_loss_data=False):
            return self._log_probs(logits, mb)

        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            outputs = self._schedule(chunks, micro_batches, collect, forward_only=True, forward=forward)
        return [tuple(cp_full(x, self.layout) for x in out) for out in outputs]

    def _from_last_stage(self, obj):
        """Rank 0 returns results; the last pipeline stage computed them."""
        layout = self.layout
        if layout.pp_size == 1:
            return obj
        out = [obj if layout.rank == layout.pp_last_rank else None]
        dist.broadcast_object_list(out, src=layout.pp_last_rank, group=layout.pp_group)
        return out[0]

    # -- weights and checkpoints -----------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors (a collective; rank 0 returns them)."""
        return self.weights.gather(self.actor) | (self.weights.passthrough if self.layout.rank == 0 else {})

    def save_checkpoint(self, path: str) -> None:
        """The actor as an HF directory, and this rank's optimizer and RNG state."""
        weights = self.named_weights()
        save_optimizer_state(self.optimizer, path, self.layout.rank, {"skipped_steps": self.skipped_steps})
        if self.layout.rank == 0:
            save_hf_dir(Path(path) / "hf", self.hf_config, weights)

    def load_checkpoint(self, path: str) -> None:
        """Restore optimizer and RNG state and the skipped-step count (the weights were loaded
        from <path>/hf)."""
        counters = load_optimizer_state(self.optimizer, path, self.layout.rank)
        self.skipped_steps = counters.get("skipped_steps", 0)
        self.first_step = False

    def shutdown(self) -> None:
        # optional: megatron-core (relax[megatron])
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
