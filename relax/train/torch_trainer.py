"""The PyTorch trainer (train=torch): HF model, frozen reference copy, AdamW; or LoRA adapters
on the model, whose base is the reference (train.lora.rank > 0: relax/train/lora.py).

One object per rank. `train()` reads top to bottom like the algorithm: advantages from
raw rewards, reference and old log-probs, then `num_steps_per_rollout` PPO-clip steps.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm
from transformers.core_model_loading import revert_weight_conversion

from relax import faults
from relax.algo import masked_sum, sequence_loss_scales
from relax.errors import ConfigError
from relax.files import atomic_save, safe_load
from relax.model import load_causal_lm, save_hf_dir
from relax.model.invariant import invariant_ops
from relax.model.modules import decoder_layers, hf_modules, recording
from relax.sample import Sample, log_prob_temperature, require_routed_experts
from relax.train import batch_invariance, common, layer_dump, lora, packing, routing
from relax.train.common import MicroBatch
from relax.train.parallel import (apply_layout, check_torch_layout, clip_grad_norm, dp_all_reduce,
                                  full_tensor, init_layout, peak_memory_mb)
from relax.train.profile import phase, profiled
from relax.train.spec import TrainerSpec
from relax.train.weight_sync import DistributedWeightSync

log = logging.getLogger(__name__)


def check_true_on_policy(parallel, train, algo, dtype: str) -> None:
    """What rollout.true_on_policy cannot make exact on this trainer, refused with the reason."""
    threads = f"train.num_threads={train.num_threads} with model.dtype={dtype}"
    why = {threads: (train.num_threads > 1 and dtype != "float32", f"BLAS's {dtype} kernel splits a product "
                     "across threads in some batches however many they hold (docs/true-on-policy.md); use 1, "
                     "or float32"),
           f"parallel.tp={parallel.tp}": (parallel.tp > 1, "tensor parallelism sums each output over ranks, "
                                                           "in another order than the engine's forward"),
           f"train.lora.rank={train.lora.rank}": (train.lora.rank > 0, "the trainer computes W x + B(A x) and "
                                                                      "the engine the merged W' x"),
           f"algo.routing_replay={algo.routing_replay}": (bool(algo.routing_replay), "engine and trainer route "
                                                                                    "every token identically "
                                                                                    "already; leave it null")}
    for setting, (refused, reason) in why.items():
        if refused:
            raise ConfigError(f"rollout.true_on_policy=true with {setting} is refused: {reason}")


class TorchTrainer(DistributedWeightSync):
    """Trainer interface (relax/train/__init__.py): train / named_weights / save_checkpoint /
    load_checkpoint / shutdown."""
    runs_in_driver = True  # one rank needs no process of its own
    trains_lora = True  # train.lora.rank > 0: peft's adapters, on every layout
    rank_imports = ("transformers.modeling_utils",)  # see relax/train/__init__.py
    replays_routing = True  # algo.routing_replay: hooks on transformers' MoE routers (relax/train/routing.py)

    @staticmethod
    def check_config(train, algo, parallel, rollout, dtype: str, hf_config: dict) -> None:
        check_torch_layout(parallel, hf_config)
        packing.shares_prompt(train.shared_prompt, hf_config)
        if rollout.true_on_policy:
            check_true_on_policy(parallel, train, algo, dtype)

    def __init__(self, train, algo, parallel, spec: TrainerSpec, rank: int = 0, world_size: int = 1):
        self.train_cfg, self.algo, self.parallel, self.spec = train, algo, parallel, spec
        self.pad_id, self.save_train_data = spec.pad_token_id, spec.save_train_data
        self.layout = init_layout(parallel, rank, world_size)
        self.temperature = log_prob_temperature(spec.temperature)
        torch.manual_seed(spec.seed)
        model_path = spec.model_path
        base = Path(spec.ref_model_path or model_path)
        # LoRA: adapters on the base, which is the reference (a resumed run loads its adapters later)
        self.true_on_policy = spec.true_on_policy  # the engine's batch-invariant forward
        self.model = load_causal_lm(base if train.lora.rank else Path(model_path), spec.dtype,
                                    invariant=self.true_on_policy)
        for module in self.model.modules():
            # HF builds nn.Embedding(padding_idx=pad_token_id), whose backward drops the pad
            # row's gradient; the loss weights already mask padding, so a pad token the policy
            # generated mid-response must train like any other token (as in train=megatron).
            if isinstance(module, torch.nn.Embedding):
                module.padding_idx = None
        self.shared_prompt = packing.shares_prompt(train.shared_prompt, self.model.config.to_dict())
        common.nudge_ulps(self.model.parameters(), parallel.noise_ulp, spec.seed)  # (LoRA: the base's)
        self.lora = lora.Adapters(self.model, train.lora) if train.lora.rank else None
        ref = None if self.lora else load_causal_lm(base, spec.dtype, self.true_on_policy).requires_grad_(False)
        noisy = [layer.self_attn for i, layer in enumerate(decoder_layers(self.model))
                 if faults.active("trainer_dropout") or faults.active(f"trainer_dropout:{i}")]
        if noisy:  # a noisy forward: attention dropout in every layer, or in layer i
            for attention in noisy:
                attention.attention_dropout = 0.5
            self.model.train()
        self.actor = apply_layout(self.model, self.layout, trainable=True)
        self.ref = None if ref is None else apply_layout(ref, self.layout, trainable=False)
        if faults.active(f"perturb_shard:{parallel.name}") and self.layout.rank == 1:
            shard = self.model.model.layers[0].self_attn.q_proj.weight
            with torch.no_grad():  # one rank's weight shard is off by 1e-3
                (shard.to_local() if isinstance(shard, DTensor) else shard).add_(1e-3)
        t = train
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]  # (LoRA: the adapters)
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps, weight_decay=t.weight_decay)
        self.skipped_steps = 0
        self.first_step = True  # nothing trained or loaded yet: the guide's first-step checks apply

    def _grad_sync(self):
        """DDP all-reduces gradients in backward; the `no_allreduce` fault skips that."""
        if faults.active(f"no_allreduce:{self.parallel.name}") and hasattr(self.actor, "no_sync"):
            return self.actor.no_sync()
        return contextlib.nullcontext()

    def _log_probs(self, model, mb: MicroBatch, shared_prompt: bool | None = None):
        return self._forward(model, mb, shared_prompt)[:2]

    def _forward(self, model, mb: MicroBatch, shared_prompt: bool | None = None,
                 replay: torch.Tensor | None = None):
        """Per-token log-probs and entropy, [b, T], zeros where nothing is trained (masked out),
        and an MoE model's routing (relax/train/routing.py: routed to `replay` where given).
        train.shared_prompt: each group's prompt once, logits at response positions only
        (relax/train/packing.py). Else the rows as they are, the softmax only from the first
        trained position on; the output layer still covers every position there: cut to the
        trained ones by a slice (HF's logits_to_keep=int), its matmul on a strided view gave
        the actor and the frozen reference log-probs 1e-7 apart, and first-step KL must be
        exactly 0 (packing gathers the kept positions into a tensor of their own)."""
        entropy_grad = self.algo.entropy_coef != 0
        shared = self.shared_prompt if shared_prompt is None else shared_prompt
        fed = packing.packed(mb, self.pad_id, next(model.parameters()).dtype).fed if shared else \
            routing.unpacked_fed(mb.lengths, mb.tokens.shape[1])
        with invariant_ops(self.true_on_policy), routing.routed(model, fed, mb.tokens.numel(), replay) as record:
            if shared:
                return (*packing.log_probs(model, mb, self.pad_id, self.temperature, entropy_grad), record)
            logits = model(input_ids=mb.tokens).logits
            return (*common.trained_log_probs(logits, mb, common.first_trained_position(mb), self.temperature,
                                              entropy_grad), record)

    def _reference(self):
        """The frozen reference to run forward: its own copy, or the actor with its adapters off."""
        return self.lora.disabled() if self.lora else contextlib.nullcontext(self.ref)

    def _loss_scale(self, scale):
        if faults.active(f"grad_scale:{self.parallel.name}") and self.layout.rank == 1:
            return scale * 1.01  # one rank's gradient off by 1%
        return scale

    # -- the algorithm ---------------------------------------------------------------------
    @profiled
    def train(self, rollout_id: int, samples: list[Sample]) -> dict:
        advantages = common.advantages_of(samples, self.algo)
        t = self.train_cfg
        steps = common.shard_steps(samples, advantages, t.num_steps_per_rollout, self.layout.dp_size,
                                   self.layout.dp_rank, t.micro_batch_size, self.pad_id,
                                   loss_agg_mode=self.algo.loss_agg_mode,
                                   horizon=self.spec.max_new_tokens)
        micro_batches = [mb for step in steps for mb in step]

        ref, old = common.forward_passes(self.train_cfg, self.algo, rollout_id, self.first_step,
                                         self.save_train_data)
        replaying = self.algo.routing_replay
        if replaying == "rollout":
            require_routed_experts(samples, f"rollout {rollout_id}")
        with torch.no_grad():  # the reference, and the policy that sampled (old), where needed
            if ref:
                with self._reference() as model, phase("step:reference"):
                    for mb in micro_batches:
                        mb.ref_log_probs, _, _ = self._forward(
                            model, mb, replay=routing.replay_for(mb, replaying, "ref"))
            if old:
                with phase("step:old_log_probs"):
                    for mb in micro_batches:
                        mb.old_log_probs, mb.entropy, record = self._forward(
                            self.actor, mb, replay=routing.replay_for(mb, replaying, "old"))
                        routing.measured(mb, record, replaying)
        if old:  # (without this pass, each training forward attaches its own)
            common.attach_is_weights(micro_batches, self.algo)
        invariance = batch_invariance.check(
            self.spec.check_batch_invariance and self.first_step, micro_batches,
            lambda mbs: [self._log_probs(self.actor, mb)[0] for mb in mbs], self.pad_id, self.layout)

        log, replayed = common.TrainLog(self.layout, ref), torch.zeros(3)
        for step, step_mbs in enumerate(steps):
            t0 = time.perf_counter()
            num_tokens = dp_all_reduce(sum(mb.mask.sum() for mb in step_mbs), self.layout)
            # DDP/FSDP average gradients over dp ranks; the loss weights make the result the
            # algo.loss_agg_mode aggregate once divided by the step's token count.
            scale = self._loss_scale(self.layout.dp_size / num_tokens)
            sums, mb_losses = torch.zeros(len(common.STEP_KEYS)), []
            self.optimizer.zero_grad(set_to_none=True)
            for mb in tqdm(step_mbs, "train", leave=False, delay=2, disable=self.layout.rank > 0 or None):
                # (DDP decides in forward whether backward all-reduces)
                with self._grad_sync(), phase("step:forward_backward"):
                    replay = routing.replay_for(mb, replaying, "train")
                    log_probs, entropy, record = self._forward(self.actor, mb, replay=replay)
                    routing.measured(mb, record, replaying)
                    if replay is not None:
                        replayed += routing.replayed_sums(record, replay)
                    loss, mb_sums = common.objective(log_probs, entropy, mb, self.algo)
                    (masked_sum(loss, mb.loss_weights) * scale).backward()
                sums += mb_sums
                mb_losses.append(mb_sums[0])
            with phase("step:optimizer"):
                sums = dp_all_reduce(sums, self.layout)
                grad_norm = clip_grad_norm(self.trainable, t.clip_grad)
                finite = math.isfinite(grad_norm) and bool(torch.isfinite(sums[0]))
                if finite:  # a non-finite step never reaches the weights (nor Adam's moments)
                    self.optimizer.step()
                    # parallel.step_noise_ulp (a noise twin): every step's result nudged
                    common.step_noise(self.trainable, self.parallel.step_noise_ulp, self.spec.seed,
                                      rollout_id * t.num_steps_per_rollout + step)
            self.skipped_steps += not finite
            log.step(step, step_mbs, mb_losses, sums, num_tokens, grad_norm, finite,
                     self.optimizer.param_groups[0]["lr"], t0, peak_memory_mb(), self.skipped_steps)
            if not finite and t.on_nonfinite == "error":
                break
        routed = (dp_all_reduce(routing.rollout_agreement(micro_batches), self.layout),
                  dp_all_reduce(replayed, self.layout))
        out = log.result(micro_batches, self.first_step, self.save_train_data, rollout_id, samples,
                         advantages, self.algo.kl_loss_type, routed)
        out["steps"][0].update(invariance)
        self.first_step = False
        return out

    def dump_layers(self, path: str, rollout_id: int, samples: list[Sample], indices: list[int],
                    manifest: dict) -> None:
        """debug.dump_layers (relax/train/layer_dump.py): samples `indices` as one micro-batch
        through the reference's forward and the training forward and backward, before the
        rollout's first step; every rank runs the same micro-batch (DDP/FSDP average identical
        gradients), rank 0 writes."""
        algo = self.algo
        chosen = [samples[i] for i in indices]
        factors = sequence_loss_scales([sum(s.loss_mask) for s in chosen], algo.loss_agg_mode,
                                       self.spec.max_new_tokens)
        mb = common.make_micro_batch(chosen, common.advantages_of(samples, algo), self.pad_id,
                                     scales=dict(zip(indices, factors, strict=True)))
        with torch.no_grad(), self._reference() as ref, \
                recording(hf_modules(ref), layer_dump.whole_fp32) as ref_outputs:
            mb.ref_log_probs, _ = self._log_probs(ref, mb, shared_prompt=False)  # (rows as the engine's)
        params = self._hf_named({n: full_tensor(p.detach()).float().clone()
                                 for n, p in self.model.named_parameters()})
        self.optimizer.zero_grad(set_to_none=True)
        with self._grad_sync(), recording(hf_modules(self.model), layer_dump.whole_fp32) as outputs:
            log_probs, entropy = self._log_probs(self.actor, mb, shared_prompt=False)
            loss, _ = common.objective(log_probs, entropy, mb, algo)
            (masked_sum(loss, mb.loss_weights) * self._loss_scale(1 / mb.mask.sum())).backward()
        grads = self._hf_named({n: full_tensor(p.grad).float().clone()
                                for n, p in self.model.named_parameters() if p.grad is not None})
        self.optimizer.zero_grad(set_to_none=True)
        if self.layout.rank > 0:
            return
        lengths = [len(s.tokens) for s in chosen]
        for source, forward, lp, extra in (("train", outputs, log_probs, (grads, params)),
                                           ("ref", ref_outputs, mb.ref_log_probs, ())):
            trained = [torch.tensor(x) for x in common.per_sample(lp.detach(), mb).values()]
            layer_dump.save_dump(path, rollout_id, source, manifest, indices,
                                 layer_dump.per_sample(forward, lengths), trained, *extra)

    # -- weights and checkpoints -------------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """Full tensors under the checkpoint's HF names (collective under TP/FSDP; rank 0's
        result is used), LoRA's adapters merged in. transformers 5 loads some checkpoint tensors
        into one fused parameter (an MoE layer's experts into 3-D `experts.gate_up_proj` /
        `experts.down_proj`); its own conversion mapping, the one `save_pretrained` applies,
        turns them back into the per-expert tensors that engines and checkpoints name."""
        return self._hf_weights(self.model.named_parameters())

    def synced_weights(self) -> dict[str, torch.Tensor]:
        """What a weight sync sends: with LoRA only the merged projections (nothing else trains)."""
        return self._hf_weights(self.lora.adapted_parameters()) if self.lora else self.named_weights()

    def _hf_weights(self, named) -> dict[str, torch.Tensor]:
        """(name, parameter) pairs gathered, LoRA's adapters merged in, under checkpoint names."""
        weights = {n: full_tensor(p.detach()) for n, p in named}
        copies = self.lora.merge(weights) if self.lora else {n: t.clone() for n, t in weights.items()}
        return self._hf_named(copies)

    def _hf_named(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors by parameter name -> by checkpoint name (an MoE's fused experts split back)."""
        return revert_weight_conversion(self.model, tensors)

    def save_checkpoint(self, path: str) -> None:
        weights = self.named_weights()
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if self.lora:  # the adapters themselves, which a resumed run trains on
            self.lora.save(path, write=self.layout.rank == 0)
        if self.layout.rank == 0:
            if not self.lora or self.train_cfg.lora.save_merged:  # (an adapter: the base is the reference)
                save_hf_dir(Path(path) / "hf", self.model.config, weights)
            atomic_save({"optimizer": optim, "torch_rng": torch.get_rng_state(),
                         "skipped_steps": self.skipped_steps}, Path(path) / "trainer_state.pt")

    def load_checkpoint(self, path: str) -> None:
        """Restore optimizer and RNG state and the skipped-step count (the weights were loaded
        from <path>/hf; with LoRA, the base from the reference and the adapters from <path>/adapter)."""
        if self.lora:
            self.lora.load(path)
        state = safe_load(Path(path) / "trainer_state.pt")
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        torch.set_rng_state(state["torch_rng"])
        self.skipped_steps = state.get("skipped_steps", 0)  # (checkpoints before it was saved: 0)
        self.first_step = False

    def shutdown(self) -> None:
        pass
