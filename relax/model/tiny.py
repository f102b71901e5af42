"""The built-in tiny model: a Qwen2 causal LM that Relax creates, warms up and caches itself.

No download: a character-level tokenizer is built with `tokenizers`, the model is a
transformers Qwen2 initialised from a fixed seed, and a short supervised warm-up on the
arithmetic task brings greedy accuracy to `warmup_target_accuracy`, so that GRPO starts
with sampled rewards around 0.2-0.4 (where it learns; see docs/measured-on-cpu.md).
The result is an ordinary HF directory, reused on later runs.

How it works in detail: docs/models.md, "Inside `relax/model/tiny.py`".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2MoeConfig

from relax import faults
from relax.errors import ConfigError
from relax.files import sha256
from relax.model.temp_dirs import remove_stale, temp_dir_beside
from relax.task.arithmetic import make_problem

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).with_name("tiny_qwen2")  # the default recipe, built once, shipped
# the sha256 of SHIPPED/model.safetensors
SHIPPED_SHA256 = "5431869146292c62b29576f5376c7fc772fed1dcb5e15e0ef73c52fc3414c222"

FORMAT = 1  # bump when the recipe below changes, so old caches are not reused
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|unk|>"]
CHARS = list("0123456789+-*= ")
VOCAB_SIZE = 32  # padded up so that any tp up to 8 divides it
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer():
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>", unk_token="<|unk|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_config(recipe, tokenizer):
    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=recipe.hidden_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
        intermediate_size=recipe.intermediate_size, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_dropout=0.0,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    if recipe.num_experts:
        return Qwen2MoeConfig(
            **common, architectures=["Qwen2MoeForCausalLM"], num_experts=recipe.num_experts,
            num_experts_per_tok=2,
            moe_intermediate_size=recipe.intermediate_size // 2,
            shared_expert_intermediate_size=recipe.shared_expert_intermediate_size,
            decoder_sparse_step=1, norm_topk_prob=True, output_router_logits=False,
        )

    return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])  # (as save_pretrained writes it)


def _batch(tokenizer, rng, n, min_operand=10, max_operand=99):
    """Chat-formatted `a+b=` prompts with their answers, as (tokens, loss mask) pairs."""
    seqs, masks = [], []
    for _ in range(n):
        q, a = make_problem(rng, min_operand, max_operand)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p + r)
        masks.append([0] * len(p) + [1] * len(r))
    width = max(map(len, seqs))
    pad = lambda xs, v: [x + [v] * (width - len(x)) for x in xs]  # noqa: E731
    return torch.tensor(pad(seqs, tokenizer.pad_token_id)), torch.tensor(pad(masks, 0))


def warm_up(model, tokenizer, recipe) -> float:
    """Supervised warm-up until greedy accuracy reaches the target; returns that accuracy.

    Greedy accuracy is measured teacher-forced: greedy decoding reproduces the answer
    exactly iff the argmax is right at every answer position, so one forward suffices.
    """
    rng = random.Random(recipe.seed)
    eval_x, eval_m = _batch(tokenizer, random.Random(recipe.seed + 1), 256)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.warmup_lr)
    accuracy = 0.0
    for step in range(1, recipe.warmup_max_steps + 1):
        x, m = _batch(tokenizer, rng, recipe.warmup_batch_size)
        logits = model(x).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), x[:, 1:], reduction="none")
        loss = (loss * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0:
            with torch.no_grad():
                pred = model(eval_x).logits[:, :-1].argmax(-1)
            ok = (pred == eval_x[:, 1:]) | (eval_m[:, 1:] == 0)
            accuracy = ok.all(-1).float().mean().item()
            log.info("tiny model warm-up step %d: loss %.3f, greedy accuracy %.2f",
                     step, loss.item(), accuracy)
            if accuracy >= recipe.warmup_target_accuracy:
                break
    return accuracy


MAX_PARAMETERS = 10**9  # the tiny model is built and warmed up on this machine's CPU, at start-up


def check_recipe(tiny) -> None:
    """model.tiny.* values that build no model (refused before the recipe is built, or its
    config.json made)."""
    key = "model.tiny."
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                 "warmup_batch_size"):
        if tiny[name] < 1:
            raise ConfigError(f"{key}{name}={tiny[name]}: expected a positive integer")
    for name in ("shared_expert_intermediate_size", "warmup_max_steps", "warmup_lr"):
        if tiny[name] < 0:
            raise ConfigError(f"{key}{name}={tiny[name]}: expected a number >= 0")
    if tiny.hidden_size % tiny.num_heads or tiny.hidden_size // tiny.num_heads % 2:
        raise ConfigError(f"{key}num_heads={tiny.num_heads}: expected heads of an even width (RoPE rotates "
                          f"pairs): a divisor of model.tiny.hidden_size={tiny.hidden_size} that leaves an "
                          f"even quotient")
    if tiny.num_heads % tiny.num_kv_heads:
        raise ConfigError(f"{key}num_kv_heads={tiny.num_kv_heads}: expected a divisor of "
                          f"model.tiny.num_heads={tiny.num_heads} (each key/value head serves a group of "
                          f"heads)")
    if tiny.num_experts == 1 or tiny.num_experts < 0:
        raise ConfigError(f"{key}num_experts={tiny.num_experts}: expected 0 (a dense model) or at least 2 "
                          f"(each token is routed to 2 experts)")
    if tiny.num_experts and tiny.intermediate_size < 2:
        raise ConfigError(f"{key}intermediate_size={tiny.intermediate_size}: expected at least 2 with "
                          f"experts (each expert is half as wide)")
    if tiny.shared_expert_intermediate_size and not tiny.num_experts:
        raise ConfigError(f"{key}shared_expert_intermediate_size={tiny.shared_expert_intermediate_size}: "
                          f"a dense model (model.tiny.num_experts=0) has no shared expert; set it to 0")
    if not 0 <= tiny.warmup_target_accuracy <= 1:
        raise ConfigError(f"{key}warmup_target_accuracy={tiny.warmup_target_accuracy}: expected an "
                          f"accuracy in [0, 1]")
    sizes = ("hidden_size", "num_layers", "intermediate_size", "num_experts")
    h, layers = tiny.hidden_size, tiny.num_layers
    parameters = layers * (4 * h * h + 3 * h * tiny.intermediate_size * max(tiny.num_experts, 1))
    if parameters > MAX_PARAMETERS:
        named = ", ".join(f"{key}{k}={tiny[k]}" for k in sizes)
        raise ConfigError(f"{named} make a model of {parameters:.1e} parameters: expected at most "
                          f"{MAX_PARAMETERS:.0e} (the tiny model is built and warmed up on this machine's "
                          f"CPU at start-up; model=hf loads a larger one)")


def tiny_model_dir(model_cfg) -> Path:
    recipe = json.dumps({"format": FORMAT, **dict(model_cfg.tiny)}, sort_keys=True)
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:10]
    return Path(os.path.expanduser(model_cfg.cache_dir)) / "models" / f"tiny-qwen2-{digest}"


def tiny_config(model_cfg) -> dict:
    """The tiny model's config.json: from the cache, or from the recipe before it is built."""
    check_recipe(model_cfg.tiny)
    cached = tiny_model_dir(model_cfg) / "config.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    return build_config(model_cfg.tiny, build_tokenizer()).to_dict()


def shipped_recipe() -> dict:
    return json.loads((SHIPPED / "relax_tiny.json").read_text())["recipe"]


def ensure_tiny_model(model_cfg) -> Path:
    """Return the cached tiny model directory: the shipped weights for the default recipe
    (verified), else built on first use (atomically)."""
    check_recipe(model_cfg.tiny)
    target = tiny_model_dir(model_cfg)
    remove_stale(target.parent)  # what killed builds left, even when this one is cached
    if dict(model_cfg.tiny) == shipped_recipe():
        return install_shipped(target)
    if (target / "model.safetensors").is_file():
        return target
    log.info("Creating the tiny model in %s (once; reused afterwards). A non-default recipe is "
             "built on this machine's CPU kernels: other machines get other weights", target)
    return publish(lambda out: build(model_cfg.tiny, out), target)


def install_shipped(target: Path) -> Path:
    """Copy the shipped weights into the cache, or check the copy already there."""
    cached = target / "model.safetensors"
    if cached.is_file():
        if sha256(cached) == SHIPPED_SHA256:
            return target
        log.warning("%s is not the shipped tiny model (sha256 differs: built by an older Relax, or "
                    "changed); replacing it with the shipped one", cached)
    if sha256(SHIPPED / "model.safetensors") != SHIPPED_SHA256:
        raise ConfigError(f"{SHIPPED / 'model.safetensors'}: sha256 is not {SHIPPED_SHA256}: the "
                          f"installed Relax package is damaged; reinstall it")
    log.info("Installing the shipped tiny model into %s", target)
    return publish(lambda out: shutil.copytree(SHIPPED, out), target, replace=True)


def build(recipe, out: Path) -> Path:
    """The tiny model of `recipe` (model.tiny), warmed up, written into the new directory `out`."""
    tokenizer = build_tokenizer()
    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_config(build_config(recipe, tokenizer))
    accuracy = warm_up(model, tokenizer, recipe)
    if not all(p.isfinite().all() for p in model.parameters()):
        raise ConfigError(f"model.tiny.warmup_lr={recipe.warmup_lr}: the warm-up diverged (non-finite weights); "
                          f"expected a smaller learning rate")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "relax_tiny.json").write_text(json.dumps(
        {"recipe": dict(recipe), "warmup_greedy_accuracy": accuracy}, indent=2))
    return out


def publish(write: Callable[[Path], object], target: Path, replace: bool = False) -> Path:
    """`write(dir)` fills a new directory, which then becomes `target` by one rename (after the
    old `target` is moved aside, with `replace`): a killed build never leaves a half-written
    model under the cache name, and its temporary directory is removed by the next run."""
    with temp_dir_beside(target, "model.cache_dir") as tmp:
        write(tmp / "model")
        faults.point("model_publish")
        if replace and target.exists():
            os.replace(target, tmp / "replaced")
        try:
            os.replace(tmp / "model", target)
        except OSError:  # another process finished first; keep its copy
            pass
    return target
