"""Which architectures rollout=sglang serves on CPU beyond the families, and under which names
SGLang holds their tensors (docs/models.md, "SGLang beyond the families").

`SERVED` lists those this CPU backend (device=cpu, attention_backend=torch_native, float32) serves
as transformers computes them, each tested with a loop (tests/test_sglang_architectures.py), with
the config.json settings SGLang's model ignores; `NOT_SERVED` says why others are refused.
`relax.model.families.sglang_blocker` decides for every config.json (the families keep their
hand-written forward's limits); the start-up check and the support matrix read it. Nothing here
imports SGLang."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _window_shorter_than_context(window, hf: dict) -> bool:
    return window is not None and window < hf["max_position_embeddings"]


def _untied(tied, hf: dict) -> bool:
    return tied is False


# SGLang's Llama (Mistral's and Phi-3's model), Mixtral and Starcoder2 attend to every earlier position
IGNORES_WINDOW = {"sliding_window": (_window_shorter_than_context,
                                     "SGLang's model ignores the sliding window")}


def _tied_only(model: str) -> dict:
    return {"tie_word_embeddings": (_untied, f"SGLang's {model} uses the embedding as the output layer "
                                             f"and drops lm_head.weight")}


@dataclass(frozen=True)
class Served:
    """How SGLang serves an architecture, beyond the Llama naming sglang_to_hf reverts."""
    # q/k/v and gate/up fused in the checkpoint too (`qkv_proj`, `gate_up_proj`), as SGLang holds them
    fused_in_checkpoint: bool = False
    # an MoE expert's checkpoint names for SGLang's stacked w13 = [gate; up] and w2 = down
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # config.json settings SGLang's model ignores: key -> (test(value, config.json) -> bool, why)
    refused: dict = field(default_factory=dict)
    sglang_model: bool = True  # False: no model of SGLang's own; its transformers backend runs it


SERVED: dict[str, Served] = {  # beyond the families, which SGLang names as sglang_to_hf's default
    "CohereForCausalLM": Served(refused=_tied_only("Cohere")),
    "Gemma3ForCausalLM": Served(refused=_tied_only("Gemma 3")),
    "GraniteForCausalLM": Served(),
    "MistralForCausalLM": Served(refused=IGNORES_WINDOW),
    "MixtralForCausalLM": Served(experts=("w1", "w3", "w2"), refused=IGNORES_WINDOW),
    "Olmo2ForCausalLM": Served(),
    "Phi3ForCausalLM": Served(fused_in_checkpoint=True, refused=IGNORES_WINDOW),
    "SmolLM3ForCausalLM": Served(sglang_model=False, refused={"use_sliding_window": (
        lambda on, hf: bool(on), "sliding-window layers, not tested on SGLang's transformers backend")}),
    "Starcoder2ForCausalLM": Served(refused=IGNORES_WINDOW),
}
NOT_SERVED: dict[str, str] = {
    "Gemma2ForCausalLM": "SGLang 0.5.23's Gemma 2 reads config.hidden_act, which transformers 5's "
                         "Gemma2Config no longer has: its scheduler fails to start",
    "GPTNeoXForCausalLM": "SGLang 0.5.23 has no model for it, and its transformers backend fails to "
                          "build one on CPU (no accelerator for get_device)",
    "PhiForCausalLM": "SGLang 0.5.23's logits leave out the output layer's bias (lm_head.bias), which "
                      "Phi has",
    "GlmForCausalLM": "SGLang 0.5.23 has no model for it, and its transformers backend refuses "
                      "transformers' tensor-parallel plan for it (colwise_gather_output)",
}


def blocker(architecture: str, hf: dict) -> str | None:
    """Why rollout=sglang cannot serve this config.json of an architecture without a family (None: it can)."""
    served = SERVED.get(architecture)
    if served is None:
        return NOT_SERVED.get(architecture, "not tested with SGLang on CPU here")
    for key, (test, why) in served.refused.items():
        if test(hf.get(key), hf):
            return f"{key}={hf.get(key)!r}: {why}"
    return None


def matrix_cell(why: str | None) -> str:
    """The support matrix's SGLang cell for a blocker's answer: `runs`, or `refused` with the
    setting that decides it."""
    if why is None:
        return "runs"
    setting = why.split(":")[0]
    return f"refused ({setting})" if "=" in setting else "refused"


def sglang_to_hf(name: str, tensor: torch.Tensor, hf_config: dict) -> dict[str, torch.Tensor]:
    """SGLang's fused parameters back under the checkpoint's HF names (TP = 1). SGLang's
    models name them alike: q/k/v in `qkv_proj`, gate/up in `gate_up_proj`, and (MoE) every
    expert's [gate; up] in `experts.w13_weight` [E, 2I, H] and down in `experts.w2_weight`
    [E, H, I]; `SERVED` says where a checkpoint names them otherwise."""
    served = SERVED.get((hf_config.get("architectures") or [None])[0], Served())
    pre, _, kind = name.rpartition(".")
    if name.endswith((".experts.w13_weight", ".experts.w2_weight")):
        base = name.rsplit(".", 1)[0]
        gate, up, down = served.experts
        if name.endswith("w2_weight"):
            return {f"{base}.{e}.{down}.weight": w for e, w in enumerate(tensor)}
        return {f"{base}.{e}.{which}.weight": part for e, w in enumerate(tensor)
                for which, part in zip((gate, up), w.chunk(2), strict=True)}
    if ".qkv_proj" in name and not served.fused_in_checkpoint:
        heads, groups = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
        d = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
        q, k, v = tensor.split([heads * d, groups * d, groups * d])
        base = pre.removesuffix(".qkv_proj")
        return {f"{base}.q_proj.{kind}": q, f"{base}.k_proj.{kind}": k, f"{base}.v_proj.{kind}": v}
    if ".gate_up_proj" in name and not served.fused_in_checkpoint:
        gate, up = tensor.chunk(2)
        base = pre.removesuffix(".gate_up_proj")
        return {f"{base}.gate_proj.{kind}": gate, f"{base}.up_proj.{kind}": up}
    if name in ("model.embed_tokens.weight", "lm_head.weight"):  # SGLang pads the vocabulary
        return {name: tensor[:hf_config["vocab_size"]]}
    return {name: tensor}
