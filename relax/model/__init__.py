"""Model loading (conf/model/): the tiny built-in model, the packaged SmolLM2, or any local HF
directory of a causal LM transformers implements (relax/model/families/ says what runs it)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from relax.errors import ConfigError
from relax.model import families
from relax.model import invariant as batch_invariant
from relax.model.families import SUPPORTED_ARCHITECTURES  # noqa: F401  (re-exported)
from relax.model.gguf import ensure_packaged_model
from relax.model.hf_dir import save_hf_dir  # noqa: F401  (re-exported: the trainers' checkpoints)
from relax.model.tiny import ensure_tiny_model, tiny_config

# config.json keys that change what the weights mean; replay data records their hash.
ARCH_KEYS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim",
    "rope_theta", "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "num_experts",
)
# ...and those that only some families have, hashed only where present (so that adding
# one leaves the fingerprints of the families without it unchanged)
FAMILY_KEYS = ("num_local_experts", "rope_scaling", "qkv_bias", "attention_bias", "num_experts_per_tok",
               "norm_topk_prob", "moe_intermediate_size", "shared_expert_intermediate_size",
               "decoder_sparse_step", "mlp_only_layers")


# config.json keys every start-up check and engine reads
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def resolve_model_path(model_cfg) -> Path:
    """The HF directory this run uses; validates it before anything expensive starts."""
    if model_cfg.path is None:
        if "package" in model_cfg:  # model=smollm2
            return check_model_dir(ensure_packaged_model(model_cfg))
        if model_cfg.name != "tiny":
            raise ConfigError(
                f"model.path is not set for model={model_cfg.name}: pass model.path=/path/to/hf_dir "
                f"(model.name={model_cfg.name!r}: only model.name=tiny is built without one)")

        return check_model_dir(ensure_tiny_model(model_cfg))
    path = Path(model_cfg.path).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path={model_cfg.path!r}: no config.json there; expected a "
                          f"Hugging Face model directory")
    where, hf = f"model.path={model_cfg.path!r} (config.json)", read_hf_config(path)
    families.check(hf, where)
    meta_model(hf, where)
    return check_model_dir(path)


def read_hf_config(path: Path) -> dict:
    """config.json, or a ConfigError naming it (missing, not JSON, lacking a REQUIRED_KEYS key)."""
    file = Path(path) / "config.json"
    try:
        hf = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{file}: no such file; expected a Hugging Face model directory") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{file}: not valid JSON, corrupt or truncated ({e})") from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(hf, dict) or not isinstance(hf.get(k), int)]
    if missing:
        raise ConfigError(f"{file}: no integer {', '.join(missing)}: not a transformer's config.json")
    return hf


def check_model_dir(path: Path) -> Path:
    """Every *.safetensors file is whole (its header parses and covers the file exactly): a
    truncated copy or a garbage file is named here, not deep inside an engine or a rank."""
    read_hf_config(path)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors weights (Relax loads safetensors only)")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as weights:
                weights.keys()
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{f}: corrupt or truncated safetensors file ({e})") from None
    return Path(path)


def model_config(model_cfg) -> dict:
    """The config.json of the model `model_cfg` names, without loading it or building the
    tiny model: what the start-up checks read (heads, layers, vocabulary, experts)."""
    if model_cfg.path is None and model_cfg.name == "tiny":
        return tiny_config(model_cfg)
    return read_hf_config(resolve_model_path(model_cfg))


def model_fingerprint(path: Path) -> str:
    hf = read_hf_config(path)
    arch = {k: hf.get(k) for k in ARCH_KEYS} | {k: hf[k] for k in FAMILY_KEYS if k in hf}
    return hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16]


def load_tokenizer(path: Path):
    """Load the tokenizer exactly as tokenizer.json describes it.

    transformers 5.x `AutoTokenizer` maps `model_type: qwen2` to `Qwen2Tokenizer`, which
    ignores the pre-tokenizer in tokenizer.json (so does SGLang not); loading the fast
    tokenizer directly keeps trainer, engines and replay data on the same token ids.
    """
    try:
        if (Path(path) / "tokenizer.json").is_file():
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # missing, corrupt or unknown tokenizer files (tokenizers raises plain Exception)
        raise ConfigError(f"{path}: cannot load its tokenizer ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not tokenizer("Hello 123", add_special_tokens=False)["input_ids"]:  # transformers builds an empty one
        raise ConfigError(f"{path}: cannot load its tokenizer (no tokenizer.json, or vocab.json and "
                          f"merges.txt, there: it encodes text into no tokens)")
    return tokenizer


def decode_responses(tokenizer, sequences: list[list[int]]) -> list[str]:
    """`tokenizer.batch_decode(sequences, skip_special_tokens=True)`, as one call into the Rust
    tokenizer where that is all transformers would do (a fast tokenizer whose decode is the
    base class's and cleans up no spaces): transformers first walks every id twice in Python
    (to_py_obj), most of the decode's time (docs/results.md)."""
    plain = type(tokenizer)._decode is PreTrainedTokenizerFast._decode
    if plain and not tokenizer.clean_up_tokenization_spaces:
        return tokenizer.backend_tokenizer.decode_batch(sequences, skip_special_tokens=True)
    return tokenizer.batch_decode(sequences, skip_special_tokens=True)


def tokenizer_fingerprint(tokenizer) -> dict:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]
    return {"vocab_size": len(vocab), "vocab_hash": digest}


def load_safetensors_dir(path: Path) -> dict:
    """Every tensor of an HF directory's *.safetensors files, by name."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors files to load")
    weights: dict = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def torch_dtype(name: str, key: str = "model.dtype"):
    """The torch dtype `name` (the value of config key `key`) names."""
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}[name]
    except KeyError:
        raise ConfigError(f"{key}={name!r}: expected float32, bfloat16 or float16") from None


def load_causal_lm(path: Path, dtype: str, invariant: bool = False):
    """transformers' model; `invariant` (rollout.true_on_policy): with the batch-invariant
    attention and MoE experts one at a time (relax/model/invariant.py)."""
    hf_logging.disable_progress_bar()  # per-load bars are noise (and leak a lock per rank)
    implementations = {"attn_implementation": attention_implementation(path)}
    if invariant:
        batch_invariant.register()
        implementations = {"attn_implementation": batch_invariant.INVARIANT, "experts_implementation": "eager"}
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype), **implementations)


def meta_model(hf: dict, where: str = "config.json"):
    """transformers' model for config.json `hf` on the meta device (its module names and types,
    no weights): a config transformers cannot build is refused here, not in a rank or an engine."""
    hf = dict(hf)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf))
    except Exception as e:  # whatever transformers raises for a config it cannot build
        raise ConfigError(f"{where}: transformers cannot build this model ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None


def attention_implementation(path: Path) -> str:
    """PyTorch's sdpa where transformers' model takes it, else its eager attention (Gemma 2's
    soft-capped attention logits): every engine and trainer on transformers' forward uses this."""
    model_class = AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(str(path)))]
    return "sdpa" if model_class._supports_sdpa else "eager"
