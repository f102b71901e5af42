"""The Megatron-core trainer (train=megatron): GPTModel built from the HF checkpoint.

Same RL math and batching as train=torch (relax.train.common); the machinery is
Megatron's: `parallel_state` for TP/PP/VPP/CP/EP/DP groups, GPTModel with local layer
specs on CPU (Transformer Engine specs on GPU), `get_forward_backward_func` schedules for
the reference/old log-probs (forward only) and the training step, Megatron DDP with the
distributed optimizer, and its grad clipping (`train/grad_norm` comes from Megatron).
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from relax.distributed import free_port
from relax.algo import masked_sum, token_log_probs
from relax.errors import ConfigError
from relax.model import load_safetensors_dir, torch_dtype
from relax.files import atomic_save, safe_load
from relax.sample import Sample, log_prob_temperature
from relax.train import common
from relax.train.common import MicroBatch
from relax.train.megatron import checks, convert
from relax.train.parallel import peak_memory_mb
from relax.train.weight_sync import DistributedWeightSync

log = logging.getLogger(__name__)
GPU = torch.cuda.is_available()


def check_megatron_layout(cfg, hf_config) -> None:
    p = cfg.parallel
    if p.fsdp:
        raise ConfigError(f"parallel={p.name}: fsdp is train=torch's FSDP2; train=megatron shards "
                          f"optimizer state over dp with its distributed optimizer "
                          f"(train.use_distributed_optimizer): use a layout with parallel.fsdp=false")
    if hf_config.num_hidden_layers % (p.pp * p.vpp):
        raise ConfigError(f"parallel={p.name}: {hf_config.num_hidden_layers} layers do not split "
                          f"into pp={p.pp} x vpp={p.vpp} equal chunks")
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel={p.name}: virtual pipeline stages (vpp) need pp > 1")
    if hf_config.num_key_value_heads % p.tp or hf_config.vocab_size % p.tp:
        raise ConfigError(f"parallel={p.name}: tp={p.tp} must divide the KV heads "
                          f"({hf_config.num_key_value_heads}) and the vocabulary ({hf_config.vocab_size})")
    experts = getattr(hf_config, "num_experts", 0) or 0
    if p.ep > 1 and (not experts or experts % p.ep):
        raise ConfigError(f"parallel={p.name}: ep={p.ep} needs an MoE model whose expert count is "
                          f"divisible by it (this model has {experts} experts); try "
                          f"model.tiny.num_experts=4")


def deterministic_mode() -> None:
    """train.deterministic on GPU: the settings reproducibility work calls for (set before
    NCCL, cuBLAS and Transformer Engine initialise)."""
    os.environ.setdefault("NCCL_ALGO", "Ring")                      # fixed reduction order
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")      # deterministic cuBLAS
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")   # TE: no atomics-based kernels
    torch.use_deterministic_algorithms(True)


def _main_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _init_distributed(rank: int, world_size: int) -> None:
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if GPU else "gloo", rank=rank, world_size=world_size)


class MegatronTrainer(DistributedWeightSync):
    """Trainer interface: train / named_weights / save_checkpoint / load_checkpoint / shutdown."""
    check_config = staticmethod(checks.check_config)
    checkpoint_layout = staticmethod(checks.checkpoint_layout)

    def __init__(self, cfg, model_path: str, ref_model_path: str | None = None,
                 pad_token_id: int = 0, save_train_data: str | None = None,
                 rank: int = 0, world_size: int = 1):
        from transformers import AutoConfig

        warnings.filterwarnings("ignore", module=r"megatron\.")  # "Apex/TE not installed" & co
        warnings.filterwarnings("ignore", message=".*(deprecated|non-leaf Tensor).*")
        if not GPU:
            from relax.train.megatron import cpu_compat

            cpu_compat.apply()
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        self.cfg, self.pad_id, self.save_train_data = cfg, pad_token_id, save_train_data
        self.hf_config = AutoConfig.from_pretrained(model_path)
        check_megatron_layout(cfg, self.hf_config)
        if GPU and cfg.train.deterministic:
            deterministic_mode()
        torch.set_num_threads(cfg.train.num_threads)
        self.temperature = log_prob_temperature(cfg.rollout.temperature)
        p = cfg.parallel
        _init_distributed(rank, world_size)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
            virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
            context_parallel_size=p.cp, expert_model_parallel_size=p.ep,
            expert_tensor_parallel_size=p.etp)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        self.ps = ps
        self.rank = rank
        self.layout = convert.Qwen2Layout(self.hf_config)
        self.config = self._transformer_config()
        self.ref = self._build(ref_model_path or model_path)
        actor = self._build(model_path)
        common.nudge_ulps([param for chunk in actor for param in chunk.parameters()], p.noise_ulp, cfg.seed)
        self.actor, self.optimizer = self._wrap_for_training(actor)
        self.skipped_steps = 0

    # -- building ------------------------------------------------------------------------
    def _transformer_config(self):
        from megatron.core.transformer import TransformerConfig

        h, p, t = self.hf_config, self.cfg.parallel, self.cfg.train
        dtype = torch_dtype(self.cfg.model.dtype)
        experts = getattr(h, "num_experts", 0) or None
        moe = dict(num_moe_experts=experts, moe_router_topk=h.num_experts_per_tok,
                   # HF: softmax over all experts, top-k, renormalise if norm_topk_prob;
                   # Megatron's default top-k-then-softmax is the renormalised case.
                   moe_router_pre_softmax=not h.norm_topk_prob,
                   moe_ffn_hidden_size=h.moe_intermediate_size, moe_router_load_balancing_type="none",
                   moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall",
                   moe_permute_fusion=t.moe_permute_fusion, moe_grouped_gemm=False,
                   # Qwen2-MoE's shared expert: sigmoid(x @ gate) * MLP(x), added to the experts'
                   moe_shared_expert_intermediate_size=h.shared_expert_intermediate_size or None,
                   moe_shared_expert_gate=bool(h.shared_expert_intermediate_size)) if experts else {}
        return TransformerConfig(
            num_layers=h.num_hidden_layers, hidden_size=h.hidden_size,
            num_attention_heads=h.num_attention_heads, num_query_groups=h.num_key_value_heads,
            kv_channels=self.layout.head_dim, ffn_hidden_size=h.intermediate_size,
            normalization="RMSNorm", layernorm_epsilon=h.rms_norm_eps, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False,
            add_qkv_bias=getattr(h, "attention_bias", h.model_type.startswith("qwen2")),
            hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16, tensor_model_parallel_size=p.tp,
            pipeline_model_parallel_size=p.pp,
            virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
            context_parallel_size=p.cp, sequence_parallel=p.sequence_parallel,
            expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.etp,
            use_cpu_initialization=not GPU,  # initialisation sets the TP attributes grad-norm needs
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
            calculate_per_token_loss=True,
            batch_p2p_comm=False,  # gloo trap: batched p2p pairs VPP activations with wrong grads
            deterministic_mode=t.deterministic, attention_backend=self._attention_backend(),
            **moe)

    def _attention_backend(self):
        from megatron.core.transformer.enums import AttnBackend

        if not GPU:
            return AttnBackend.local  # no Transformer Engine on CPU
        return AttnBackend[self.cfg.train.attention_backend]

    def _layer_spec(self, vp_stage):
        experts = getattr(self.hf_config, "num_experts", 0) or None
        if GPU:
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec)

            return get_gpt_layer_with_transformer_engine_spec(num_experts=experts)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm")
        if self.config.context_parallel_size > 1:
            from relax.train.megatron.cp_attention import ContextParallelAttention

            spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
        if not self.config.sequence_parallel:
            return spec
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules, get_num_layers_to_build)

        from relax.train.megatron.cpu_compat import SequenceParallelRMSNorm

        spec.submodules.input_layernorm = SequenceParallelRMSNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
        return TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(self.config, vp_stage=vp_stage),
            layer_norm=SequenceParallelRMSNorm)

    def _build(self, path: str) -> list:
        """Model chunks (one per virtual pipeline stage) holding this rank's shard of `path`."""
        from megatron.core.models.gpt import GPTModel

        h, ps = self.hf_config, self.ps
        rope = getattr(h, "rope_parameters", None) or {}
        vpp = self.cfg.parallel.vpp
        chunks = []
        for stage in range(vpp):
            vp_stage = stage if vpp > 1 else None
            chunk = GPTModel(
                config=self.config, transformer_layer_spec=self._layer_spec(vp_stage),
                vocab_size=h.vocab_size, max_sequence_length=h.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                parallel_output=False, share_embeddings_and_output_weights=h.tie_word_embeddings,
                position_embedding_type="rope",
                rotary_base=int(rope.get("rope_theta", getattr(h, "rope_theta", 10000))),
                vp_stage=vp_stage)
            chunks.append(chunk)
        hf = load_safetensors_dir(Path(path))
        self._load_hf(chunks, hf)
        # HF tensors no Megatron parameter stands for (a zero-width Qwen2-MoE shared expert
        # and its gate) are carried through unchanged, so weight sync and checkpoints stay whole.
        zero_width = not getattr(self.hf_config, "shared_expert_intermediate_size", 0)
        self.passthrough = {k: v for k, v in hf.items() if "shared_expert" in k} if zero_width else {}
        return chunks

    def _global_names(self, chunk) -> dict[str, str]:
        """Local parameter name -> global Megatron name (absolute layer/expert indices)."""
        ep_rank = self.ps.get_expert_model_parallel_rank()
        experts = getattr(self.hf_config, "num_experts", 0) or 0
        local_experts = experts // self.cfg.parallel.ep if experts else 0
        out = {}
        for name, _ in chunk.named_parameters():
            name = name.removeprefix("module.")
            m = convert.LAYER.match(name)
            if m:
                layer = chunk.decoder.layers[int(m.group(1))].layer_number - 1
                rest = m.group(2)
                e = convert.EXPERT.match(rest)
                if e:
                    rest = rest.replace(f"local_experts.{e.group(1)}.",
                                        f"local_experts.{ep_rank * local_experts + int(e.group(1))}.")
                name_global = f"decoder.layers.{layer}.{rest}"
            else:
                name_global = name
            out[name] = name_global
        return out

    def _tp(self, param):
        """(rank, size, group) of the tensor-parallel group a parameter is split over."""
        ps = self.ps
        if not getattr(param, "allreduce", True):  # an expert parameter: expert-TP group
            return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                    ps.get_expert_tensor_parallel_group())
        return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                ps.get_tensor_model_parallel_group())

    def _load_hf(self, chunks, hf: dict[str, torch.Tensor]) -> None:
        """Convert, shard and copy HF weights in; records each tensor's TP split dimension
        (where the full and local shapes differ) for gathering them back."""
        self.partition_dims: dict[str, int | None] = {}
        with torch.no_grad():
            for chunk in chunks:
                names = self._global_names(chunk)
                for name, param in chunk.named_parameters():
                    global_name = names[name.removeprefix("module.")]
                    full = convert.hf_to_megatron(global_name, hf, self.layout)
                    split = [d for d in range(full.dim()) if full.shape[d] != param.shape[d]]
                    dim = self.partition_dims[global_name] = split[0] if split else None
                    rank, size, _ = self._tp(param)
                    part = convert.shard(global_name, full, dim, rank, size)
                    if part.shape != param.shape:
                        raise ValueError(f"{global_name}: converted shape {tuple(part.shape)} != "
                                         f"Megatron's {tuple(param.shape)}")
                    param.copy_(part)

    def _wrap_for_training(self, chunks):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        t = self.cfg.train
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=t.use_distributed_optimizer)
        wrapped = [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=chunk,
                                           disable_bucketing=i > 0)
                   for i, chunk in enumerate(chunks)]
        self.config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
            clip_grad=t.clip_grad, use_distributed_optimizer=t.use_distributed_optimizer,
            params_dtype=torch_dtype(self.cfg.model.dtype),
            bf16=self.config.bf16), wrapped)
        return wrapped, optimizer

    # -- forward/backward through Megatron's schedules ------------------------------------
    def _schedule(self, chunks, micro_batches: list[MicroBatch], loss_func, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb, positions = self._cp_local(next(data_iterator))
            output = model(input_ids=mb.tokens, position_ids=positions, attention_mask=None)
            return output, partial(loss_func, mb)

        vpp = len(chunks)
        data = [iter(micro_batches) for _ in range(vpp)] if vpp > 1 else iter(micro_batches)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data,
            model=chunks if vpp > 1 else chunks[0], num_microbatches=len(micro_batches),
            seq_length=micro_batches[0].tokens.shape[1],
            micro_batch_size=micro_batches[0].tokens.shape[0],
            forward_only=forward_only, collect_non_loss_data=forward_only)

    def _forward_log_probs(self, chunks, micro_batches: list[MicroBatch]):
        """Per-position log-probs and entropy of every micro-batch (last pipeline stage only)."""
        def collect(mb, logits, non_loss_data=False):
            return token_log_probs(logits, mb.targets, self.temperature)

        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            outputs = self._schedule(chunks, micro_batches, collect, forward_only=True)
        return [tuple(map(self._cp_full, out)) for out in outputs]

    # -- context parallelism: each rank holds sequence chunks r and 2cp-1-r ---------------
    def _cp_local(self, mb: MicroBatch) -> tuple[MicroBatch, torch.Tensor]:
        """This CP rank's part of every per-position tensor, and the positions it holds."""
        positions = torch.arange(mb.tokens.shape[1]).expand_as(mb.tokens)
        if self.cfg.parallel.cp == 1:
            return mb, positions
        from megatron.core.utils import get_batch_on_this_cp_rank

        fields = ("tokens", "targets", "mask", "rollout_log_probs", "loss_weights", "old_log_probs",
                  "ref_log_probs", "entropy", "is_weights")
        per_position = {f: getattr(mb, f) for f in fields if getattr(mb, f) is not None}
        flags = dict(enumerate(mb.is_flags or ()))
        local = get_batch_on_this_cp_rank(per_position | {f"flag{k}": v for k, v in flags.items()}
                                          | {"positions": positions})
        out = MicroBatch(mb.indices, advantages=mb.advantages, **{f: local.get(f) for f in fields},
                         is_flags=tuple(local[f"flag{k}"] for k in flags) or None)
        return out, local["positions"]

    def _seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums of a CP-local [b, t] tensor over the whole sequence (no autograd)."""
        total = x.sum(-1)
        if self.cfg.parallel.cp > 1:
            dist.all_reduce(total, group=self.ps.get_context_parallel_group())
        return total

    def _cp_full(self, local: torch.Tensor) -> torch.Tensor:
        """[b, 2c] on each CP rank -> [b, 2cp*c] in sequence order (no autograd)."""
        if self.cfg.parallel.cp == 1:
            return local
        from relax.train.megatron.cp_attention import to_sequence_order

        parts = [torch.empty_like(local) for _ in range(self.cfg.parallel.cp)]
        dist.all_gather(parts, local.contiguous(), group=self.ps.get_context_parallel_group())
        return to_sequence_order(torch.stack(parts).transpose(1, 2), self.cfg.parallel.cp).T

    def _is_last_stage(self) -> bool:
        return self.ps.is_pipeline_last_stage(ignore_virtual=True)

    def _dp_sum(self, t: torch.Tensor, with_context_parallel: bool = False) -> torch.Tensor:
        """Sum over data-parallel replicas (each holds other samples) and, for per-position
        sums computed on CP-local chunks, over the context-parallel ranks too."""
        dist.all_reduce(t, group=self.ps.get_data_parallel_group(with_context_parallel=with_context_parallel))
        return t

    def _from_last_stage(self, obj):
        """Rank 0 returns results; the last pipeline stage computed them."""
        if self.ps.get_pipeline_model_parallel_world_size() == 1:
            return obj
        out = [None]
        src = self.ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(out if dist.get_rank() != src else [obj], src=src,
                                   group=self.ps.get_pipeline_model_parallel_group())
        return out[0] if dist.get_rank() != src else obj

    def train(self, rollout_id: int, samples: list[Sample]) -> dict:
        t = self.cfg.train
        advantages = common.advantages_of(samples, self.cfg.algo)
        steps = common.shard_steps(samples, advantages, t.num_steps_per_rollout,
                                   self.ps.get_data_parallel_world_size(),
                                   self.ps.get_data_parallel_rank(), t.micro_batch_size, self.pad_id,
                                   fixed_shape=True, length_multiple=self._length_multiple(),
                                   loss_agg_mode=self.cfg.algo.loss_agg_mode,
                                   horizon=self.cfg.rollout.max_new_tokens)
        micro_batches = [mb for step in steps for mb in step]
        last = self._is_last_stage()

        ref = self._forward_log_probs(self.ref, micro_batches)
        old = self._forward_log_probs(self.actor, micro_batches)
        if last:
            for mb, (ref_lp, _), (old_lp, entropy) in zip(micro_batches, ref, old):
                mb.ref_log_probs, mb.old_log_probs, mb.entropy = ref_lp, old_lp, entropy
            common.attach_is_weights(micro_batches, self.cfg.algo)
            rollout_metrics = common.rollout_record(self._dp_sum(common.rollout_sums(micro_batches)))
        step_metrics, nonfinite = [], []
        for step, step_mbs in enumerate(steps):
            t0 = time.perf_counter()
            for chunk in self.actor:
                chunk.train()
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            losses = self._schedule(self.actor, step_mbs, self._loss, forward_only=False)
            sums = self._dp_sum(sum(losses), with_context_parallel=True) if last else None
            stepped, grad_norm = self._optimizer_step(sums is None or bool(torch.isfinite(sums[0])))
            peak = peak_memory_mb()  # a collective over every rank
            if not stepped:
                self.skipped_steps += 1
            if last:
                num_tokens = self._dp_sum(sum(mb.mask.sum() for mb in step_mbs))
                if not stepped:
                    bad = [None] * self.ps.get_data_parallel_world_size()
                    dist.all_gather_object(bad, common.nonfinite_indices(step_mbs, [x[0] for x in losses]),
                                           group=self.ps.get_data_parallel_group())
                    nonfinite.append(common.nonfinite_event(step, (sums[0] / num_tokens).item(), grad_norm,
                                                            [i for part in bad for i in part]))
                step_metrics.append(common.step_record(
                    sums, num_tokens, grad_norm, self.optimizer.param_groups[0]["lr"],
                    time.perf_counter() - t0, peak, self.skipped_steps))
            if not stepped and t.on_nonfinite == "error":
                break
        result = None
        if last:
            ps = self.ps
            writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
            if self.save_train_data and writer:  # one file per DP shard, not per TP/CP replica
                common.save_train_data(self.save_train_data, rollout_id, self.ps.get_data_parallel_rank(),
                                       dist.get_rank(), samples, micro_batches, advantages,
                                       self.cfg.algo.kl_loss_type, step_metrics)
            first = [None] * self.ps.get_data_parallel_world_size()
            dist.all_gather_object(first, common.first_step_log_probs(micro_batches),
                                   group=self.ps.get_data_parallel_group())
            result = {"rollout": rollout_metrics, "steps": step_metrics, "nonfinite": nonfinite,
                      "first_step_log_probs": {i: lp for part in first for i, lp in part.items()}}
        return self._from_last_stage(result)

    def _optimizer_step(self, loss_finite: bool) -> tuple[bool, float]:
        """Megatron's optimizer.step(), split so that a non-finite loss (known on the last
        stage) or grad norm skips the update on every rank: with fp32 params Megatron has
        no inf check, and a NaN norm fails its `clip_coeff < 1` test and steps anyway."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        bad = torch.tensor(float(found_inf or not loss_finite or not math.isfinite(grad_norm)))
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            return False, grad_norm
        for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            params = inner.get_parameters()
            if inner.config.clip_grad > 0 and params:
                clip_grad_by_total_norm_fp32(params, inner.config.clip_grad, grad_norm,
                                             inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return self.optimizer.step_with_ready_grads(), grad_norm

    def _loss(self, mb: MicroBatch, logits: torch.Tensor):
        log_probs, entropy = token_log_probs(logits, mb.targets, self.temperature)
        loss, sums = common.objective(log_probs, entropy, mb, self.cfg.algo, self._seq_sum)
        # Megatron divides by the step's token count (all-reduced over DP): with the loss
        # weights, the algo.loss_agg_mode aggregate.
        return masked_sum(loss, mb.loss_weights), mb.mask.sum().int(), sums

    def _length_multiple(self) -> int:
        p = self.cfg.parallel
        return max(p.tp if p.sequence_parallel else 1, 2 * p.cp if p.cp > 1 else 1)

    # -- weights and checkpoints -----------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors, gathered over TP/PP/EP (a collective; rank 0 returns them)."""
        ps = self.ps
        mine: dict[str, torch.Tensor] = {}
        for chunk in self.actor:
            names = self._global_names(chunk.module)
            for name, param in chunk.module.named_parameters():
                global_name = names[name.removeprefix("module.")]
                dim = self.partition_dims[global_name]
                expert = not getattr(param, "allreduce", True)
                data = param.detach()
                if dim is not None:
                    _, size, group = self._tp(param)
                    parts = [torch.empty_like(data) for _ in range(size)]
                    dist.all_gather(parts, data.contiguous(), group=group)
                    data = convert.unshard(global_name, parts, dim)
                owner = (ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
                         if expert else
                         ps.get_data_parallel_rank(with_context_parallel=True) == 0
                         and ps.get_tensor_model_parallel_rank() == 0)
                if owner:
                    mine.update(convert.megatron_to_hf(global_name, data.clone(), self.layout))
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if dist.get_rank() != 0:
            return {}
        weights = {k: v for part in gathered for k, v in part.items()} | self.passthrough
        if self.hf_config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def save_checkpoint(self, path: str) -> None:
        """The actor as an HF directory, and per rank the state of each torch optimizer that
        Megatron wraps (Adam's step and moments) with the params it steps: its main params,
        i.e. this rank's shard under the distributed optimizer, fp32 copies under bf16."""
        from safetensors.torch import save_file

        weights = self.named_weights()
        state = {"torch_rng": torch.get_rng_state(),
                 "optimizers": [{"state": inner.state_dict(),
                                 "main_params": [p.detach().clone() for p in _main_params(inner)]}
                                for inner in self._inner_optimizers()]}
        atomic_save(state, Path(path) / f"trainer_state_rank{dist.get_rank():03d}.pt")
        if dist.get_rank() == 0:
            hf = Path(path) / "hf"
            hf.mkdir(parents=True, exist_ok=True)
            self.hf_config.save_pretrained(hf)
            save_file({k: v.contiguous() for k, v in weights.items()}, hf / "model.safetensors",
                      metadata={"format": "pt"})

    @torch.no_grad()
    def load_checkpoint(self, path: str) -> None:
        """Restore optimizer and RNG state (the weights were loaded from <path>/hf). The files
        are per rank, so the layout must be the one saved (checked at start-up)."""
        state = safe_load(Path(path) / f"trainer_state_rank{dist.get_rank():03d}.pt")
        for inner, saved in zip(self._inner_optimizers(), state["optimizers"], strict=True):
            inner.load_state_dict(saved["state"])
            for param, value in zip(_main_params(inner), saved["main_params"], strict=True):
                param.copy_(value)
        torch.set_rng_state(state["torch_rng"])

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers inside Megatron's (chained, distributed, mixed-precision) ones.
        Megatron's own parameter-state loaders expect TE/Apex Adam's state layout (no per-param
        `step`), so Relax saves and restores the torch optimizers directly."""
        return [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def shutdown(self) -> None:
        self.ps.destroy_model_parallel()
