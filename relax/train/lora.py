"""LoRA adapters (train.lora.*, train=torch) through peft: docs/lora.md.

How it works in detail: docs/lora.md, "Inside `relax/train/lora.py`".
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from relax import faults
from relax.errors import ConfigError
from relax.model import families, meta_model
from relax.targets import require_extra
from relax.train.parallel import ADAPTER, full_tensor

ADAPTER_DIR = "adapter"  # <checkpoint>/adapter: peft's save_pretrained files
PEFT_PREFIX = "base_model.model."  # the model's names in the peft model's state dict
A, B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


def alpha(lora) -> float:
    return lora.alpha if lora.alpha is not None else 2.0 * lora.rank


def target_modules(lora, hf_config: dict) -> list[str] | str:
    """The module names adapted: train.lora.target_modules, or the model family's default (peft's
    every linear layer but the output layer for an architecture without a hand-written family)."""
    if lora.target_modules is not None:
        return list(lora.target_modules)
    family = families.check(hf_config).family
    return list(family.lora_targets) if family else "all-linear"


def add_adapters(model: torch.nn.Module, lora):
    """peft's model around `model`, whose projections it wraps in place."""
    # optional: peft (relax[lora])
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.rank, lora_alpha=alpha(lora), lora_dropout=lora.dropout,
                        target_modules=target_modules(lora, model.config.to_dict()), task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # (peft 0.21 asks transformers 5 a deprecated question: noise)
        warnings.simplefilter("ignore", FutureWarning)
        # the adapters in model.dtype, as full fine-tuning trains every weight (peft's default: fp32)
        return get_peft_model(model, config, autocast_adapter_dtype=False)


def layout(lora) -> dict | None:
    """What a checkpoint's trainer state is tied to (relax.train.checkpoint_layout): the adapters' shape
    and scale; None without LoRA (as before LoRA existed, so older checkpoints resume)."""
    if not lora.rank:
        return None
    targets = None if lora.target_modules is None else list(lora.target_modules)
    return {"rank": lora.rank, "alpha": alpha(lora), "target_modules": targets}


def check_config(train, trainer, hf_config: dict) -> None:
    """Start-up refusals for train.lora.* (relax.train.check_trainer)."""
    lora = train.lora
    if lora.rank < 0:
        raise ConfigError(f"train.lora.rank={lora.rank}: expected 0 (LoRA off) or a positive adapter rank")
    if not lora.rank:
        return
    if not getattr(trainer, "trains_lora", False):
        raise ConfigError(f"train.lora.rank={lora.rank}: LoRA trains with train=torch only, and "
                          f"train._target_={train._target_} has no LoRA (Megatron-core has none of "
                          f"its own); use train=torch, or train.lora.rank=0")
    width = hf_config.get("hidden_size", lora.rank)
    if lora.rank > width:  # B @ A's rank is at most the layer's width
        raise ConfigError(f"train.lora.rank={lora.rank}: expected at most the model's hidden_size={width}")
    if lora.alpha is not None and not (math.isfinite(lora.alpha) and lora.alpha > 0):
        raise ConfigError(f"train.lora.alpha={lora.alpha}: expected a number > 0, or null (2 x rank)")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"train.lora.dropout={lora.dropout}: expected a probability in [0, 1)")
    if lora.target_modules is not None and not lora.target_modules:
        raise ConfigError("train.lora.target_modules=[]: expected one or more module names, or null (the "
                          "attention and MLP projections)")
    require_extra(f"train.lora.rank={lora.rank}", "peft")
    check_targets(lora, hf_config)


def matches(module: str, target: str) -> bool:
    """peft's rule for a list of target names: the module's whole name, or its last dotted parts."""
    return module == target or module.endswith(f".{target}")


def check_targets(lora, hf_config: dict) -> None:
    """The targets name linear layers of this model, and peft adapts them as such: both asked of the
    model built on the meta device (its real module names and types, no weights) with peft's
    adapters added. The family's default names what it has of them, so only an explicit name must
    match."""
    # optional: peft (relax[lora])
    from peft.tuners.lora import Linear, LoraLayer

    model = meta_model(hf_config)
    modules, key = dict(model.named_modules()), "train.lora.target_modules"
    linear = {n for n, m in modules.items() if isinstance(m, torch.nn.Linear)}
    names = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in linear}))
    for target in lora.target_modules or []:
        found = [name for name in modules if matches(name, target)]
        if not found:
            raise ConfigError(f"{key}: {target!r} matches no module of the model; its linear layers are "
                              f"named {names}")
        other = [f"{n} ({type(modules[n]).__name__})" for n in found if n not in linear]
        if other:
            raise ConfigError(f"{key}: {target!r} names {', '.join(other[:3])}, not a linear layer; LoRA "
                              f"here adapts linear layers: {names}")
        if "lm_head" in found and hf_config.get("tie_word_embeddings"):
            raise ConfigError(f"{key}: lm_head shares its weight with the embedding (tie_word_embeddings), "
                              f"so no one merged tensor holds both; leave lm_head out")
    adapted = {n: m for n, m in add_adapters(model, lora).base_model.model.named_modules()
               if isinstance(m, LoraLayer)}
    if not adapted:
        raise ConfigError(f"{key}={target_modules(lora, hf_config)}: no module of the model matches; its "
                          f"linear layers are named {names}")
    other = [n for n, m in adapted.items() if type(m) is not Linear]
    if other:
        raise ConfigError(f"{key}: peft adapts {', '.join(other[:2])} ({type(adapted[other[0]]).__name__}: "
                          f"fused 3-D expert parameters), an adapter Relax does not merge; adapt linear "
                          f"layers, e.g. {key}=[q_proj,k_proj,v_proj,o_proj]")


class Adapters:
    """peft's LoRA on an HF causal LM, which it changes in place (before any layout shards it)."""

    def __init__(self, model: torch.nn.Module, lora):
        # optional: peft (relax[lora])
        from peft.tuners.lora import LoraLayer

        self.model, self.peft = model, add_adapters(model, lora)
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
        if lora.dropout:  # (the model runs in eval mode, which would switch the adapters' dropout off)
            for layer in self.layers.values():
                layer.lora_dropout.train()

    @contextmanager
    def disabled(self):
        """The reference: the model with its adapters switched off (the base, exactly)."""
        with self.peft.disable_adapter():
            yield self.model

    def parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The adapters' parameters (what trains), by name."""
        return [(n, p) for n, p in self.model.named_parameters() if ".lora_" in n]

    def adapted_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """What a weight sync gathers: each adapted projection's base weight and its adapters (with the
        `lora_sync_unmerged` fault, the base weights alone: the engine would keep serving the base)."""
        params, base = dict(self.model.named_parameters()), ".base_layer.weight"
        suffixes = (base,) if faults.active("lora_sync_unmerged") else (base, A, B)
        return [(prefix + s, params[prefix + s]) for prefix in self.layers for s in suffixes]

    def merge(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names and tensors from peft's parameters (`weights`, which it copies): an adapted
        projection's weight W + scaling x B @ A (in fp32, then W's dtype), the rest as they are,
        the adapters themselves dropped."""
        out = {}
        for name, t in weights.items():
            prefix = name.removesuffix(".base_layer.weight")
            if prefix + A in weights:  # an adapted projection's weight, with its adapters
                a, b = weights[prefix + A].float(), weights[prefix + B].float()
                scaling = self.layers[prefix].scaling[ADAPTER]
                out[f"{prefix}.weight"] = torch.addmm(t.float(), b, a, alpha=scaling).to(t.dtype)
            elif ".lora_" not in name:
                out[name.replace(".base_layer.", ".")] = t.clone()
        return out

    def save(self, path: str, write: bool) -> None:
        """The adapters in peft's format (adapter_config.json, adapter_model.safetensors) in
        <path>/adapter: gathered on every rank (a collective under FSDP/TP), written where `write`."""
        state = {PEFT_PREFIX + n: full_tensor(p.detach()).clone() for n, p in self.parameters()}
        if write:
            self.peft.save_pretrained(str(Path(path) / ADAPTER_DIR), state_dict=state)

    def load(self, path: str) -> None:
        """The adapters `save` wrote, into every rank's (sharded) parameters."""
        # optional: peft (relax[lora])
        from peft.utils import load_peft_weights

        saved = load_peft_weights(str(Path(path) / ADAPTER_DIR), device="cpu")
        # peft saves each name without its adapter's (lora_A.default.weight -> lora_A.weight)
        state = {n: saved[PEFT_PREFIX + n.replace(f".{ADAPTER}.", ".")] for n, _ in self.parameters()}
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=False))
