"""A transformers causal LM's modules by name, whatever its family calls them: its decoder layers,
and the module outputs a layer dump records (relax/train/layer_dump.py, the torch engine)."""

from __future__ import annotations

from contextlib import contextmanager

import torch


def decoder_layers(model):
    """A transformers causal LM's decoder layers (`model.layers`, `gpt_neox.layers`, ...): the
    ModuleList of its base model with one entry per hidden layer."""
    layers = next((m for m in model.base_model.children() if isinstance(m, torch.nn.ModuleList)
                   and len(m) == model.config.num_hidden_layers), None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no list of {model.config.num_hidden_layers} decoder layers")
    return layers


# What transformers names a decoder layer's attention and MLP, and the final norm, across families
ATTENTION_NAMES = ("self_attn", "attention", "attn", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")
FINAL_NORM_NAMES = ("norm", "final_layer_norm", "final_layernorm", "ln_f", "norm_f")


def hf_modules(model) -> dict[str, torch.nn.Module]:
    """An HF causal LM's recorded modules, by name, in forward order: the embedding, per decoder
    layer its attention, its MLP and the layer, the final norm (`module_names` for the families)."""
    names = {module: name for name, module in model.named_modules()}
    norm = next((getattr(model.base_model, n) for n in FINAL_NORM_NAMES if hasattr(model.base_model, n)), None)
    if norm is None:
        raise ValueError(f"{type(model).__name__}: no final norm ({', '.join(FINAL_NORM_NAMES)}) to record")
    out = {names[model.get_input_embeddings()]: model.get_input_embeddings()}
    for layer in decoder_layers(model):
        parts = [next((getattr(layer, n) for n in group if hasattr(layer, n)), None)
                 for group in (ATTENTION_NAMES, MLP_NAMES)]
        out |= {names[m]: m for m in (*parts, layer) if m is not None}
    return out | {names[norm]: norm}


@contextmanager
def recording(modules: dict[str, torch.nn.Module], take):
    """Forward hooks on `modules` (by HF name): each puts `take(its output)` into the yielded
    dict while the block runs (a module returning a tuple, its first element: the output comes
    first, a bias or the context after it)."""
    into: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args, output):
            into[name] = take(output[0] if isinstance(output, tuple) else output)

        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in modules.items()]
    try:
        yield into
    finally:
        for h in handles:
            h.remove()
