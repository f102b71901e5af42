"""StarCoder2 (Starcoder2ForCausalLM): LayerNorm, a non-gated GELU MLP (`c_fc`, `c_proj`), biases on
every linear layer (`use_bias`) and Mistral's sliding window. Megatron's layer spec only:
transformers' forward elsewhere."""

from relax.model.families import Family

FAMILY = Family(
    architecture="Starcoder2ForCausalLM", model_type="starcoder2", qkv_bias=True, qkv_bias_key="use_bias",
    hand_written=False, sliding_window=True, norm="LayerNorm", norm_eps_key="norm_epsilon", gated_mlp=False,
    linear_bias_key="use_bias",
    checkpoint_names={f"mlp.{ours}_proj.{kind}": f"mlp.{theirs}.{kind}" for ours, theirs in
                      (("up", "c_fc"), ("down", "c_proj")) for kind in ("weight", "bias")},
)
