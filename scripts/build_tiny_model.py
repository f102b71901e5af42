"""Build the default tiny model with Relax's own recipe (relax/model/tiny.py) and compare it
with the shipped copy, or (--write) replace the shipped copy and print its new sha256.

    .venv/bin/python scripts/build_tiny_model.py            # does this machine build the shipped bytes?
    .venv/bin/python scripts/build_tiny_model.py --write    # then set SHIPPED_SHA256 in relax/model/tiny.py

The build is fp32 AdamW on the CPU, so its bytes depend on the CPU's instruction set: that is
why the weights ship instead of being built on every machine (docs/models.md).
"""

import argparse
import logging
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

from relax.config import TinyModelConfig
from relax.model import tiny


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="replace relax/model/tiny_qwen2/ with the build")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    built = tiny.build(OmegaConf.structured(TinyModelConfig), Path(tempfile.mkdtemp()) / "tiny")
    digest = tiny.sha256(built / "model.safetensors")
    print(f"built {built}: model.safetensors sha256 {digest} (shipped: {tiny.SHIPPED_SHA256})")
    if args.write:
        shutil.rmtree(tiny.SHIPPED, ignore_errors=True)
        shutil.copytree(built, tiny.SHIPPED)
        print(f"wrote {tiny.SHIPPED}; set SHIPPED_SHA256 = {digest!r} in relax/model/tiny.py")
        return 0
    return 0 if digest == tiny.SHIPPED_SHA256 else 1


if __name__ == "__main__":
    sys.exit(main())
