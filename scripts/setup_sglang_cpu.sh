#!/usr/bin/env bash
# Build the separate virtual environment in which Relax runs real SGLang on the CPU.
#
#   scripts/setup_sglang_cpu.sh            # build, or check and reuse a working one
#   scripts/setup_sglang_cpu.sh --force    # delete the environment and build it anew
#   scripts/setup_sglang_cpu.sh --background  # build (or check) it in the background, logging to
#                                          # <venv>.log; a later run waits for it, then checks it
#
# Environment variables:
#   RELAX_SGLANG_VENV    where the environment lives (default: <repo>/.venv-sglang)
#   PYTHON               interpreter to build it from (default: python3.11; must be 3.11)
#   RELAX_SGLANG_VERBOSE set to 1 to see pip's full output
#
# What it does (SGLang 0.5.23 is not built for CPUs; this is the recipe that works here):
#   1. torch==2.13.0: the CPU wheel (pip takes it from /opt/wheels where that exists);
#   2. the exact versions in scripts/sglang-cpu-requirements.txt: SGLang's own
#      requirements less its GPU-only ones, plus what Relax and its tests need;
#   3. sglang==0.5.23 with --no-deps (it pins torch==2.14.1 and CUDA-only packages);
#   4. guards the two register_fake calls in torchvision/_meta_registrations.py, since
#      PyPI's torchvision is a CUDA build whose ops do not load beside the CPU torch
#      ("operator torchvision::nms does not exist") and SGLang imports torchvision;
#   5. puts scripts/sglang_cpu_shims (a pure-PyTorch vllm._custom_ops.rotary_embedding,
#      which SGLang's non-CUDA rotary path imports) at the end of sys.path via a .pth;
#   6. installs Relax itself editable with --no-deps (its pins are not touched);
#   7. checks that everything imports, then writes a stamp so the next run is quick.
# Use it as: $RELAX_SGLANG_VENV/bin/python, with device="cpu",
# attention_backend="torch_native", dtype="float32", disable_cuda_graph=True.
set -euo pipefail

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
PIP_VERSION=26.0.1

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RELAX_SGLANG_VENV:-$REPO/.venv-sglang}"
REQ="$REPO/scripts/sglang-cpu-requirements.txt"
SHIMS="$REPO/scripts/sglang_cpu_shims"
PYTHON="${PYTHON:-python3.11}"
START=$SECONDS

log() { printf '[setup-sglang-cpu %4ss] %s\n' "$((SECONDS - START))" "$*"; }
die() { log "ERROR: $*" >&2; exit 1; }

FORCE=0
BACKGROUND=0
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    --background) BACKGROUND=1 ;;
    -h|--help) sed -n '2,12p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown argument: $arg" ;;
  esac
done

[[ -f "$REQ" ]] || die "missing $REQ"
[[ -f "$SHIMS/vllm/_custom_ops.py" ]] || die "missing $SHIMS/vllm/_custom_ops.py"

# One build of an environment at a time: a run that finds another (a --background one) waits
# for it. A background build holds the lock its starter took (fd 9, inherited).
if [[ -z "${RELAX_SGLANG_LOCK_HELD:-}" ]]; then
  command -v flock >/dev/null || die "flock not found (util-linux)"
  exec 9>"$VENV.lock"
  if ! flock -n 9; then
    log "another build of $VENV is running (log: $VENV.log); waiting for it"
    flock 9
    log "it finished; checking what it left"
  fi
fi
if [[ "$BACKGROUND" == 1 ]]; then
  log "building $VENV in the background; log: $VENV.log"
  RELAX_SGLANG_LOCK_HELD=1 nohup "${BASH_SOURCE[0]}" $([[ "$FORCE" == 1 ]] && echo --force) \
    >"$VENV.log" 2>&1 </dev/null &
  exit 0
fi

# What this build is made of; a stamp with another value means "rebuild".
STAMP_FILE="$VENV/.relax-sglang-cpu-stamp"
STAMP="$(cat "${BASH_SOURCE[0]}" "$REQ" "$SHIMS"/vllm/*.py | sha256sum | cut -c1-16) repo=$REPO"

# Quiet pip by default, and drop the harmless notes about this machine's local indexes.
PIP_QUIET=(-q)
[[ "${RELAX_SGLANG_VERBOSE:-0}" == 1 ]] && PIP_QUIET=()
# (not --no-compile: where PYTHONDONTWRITEBYTECODE is set, every import would compile again)
pip_install() {
  "$VENV/bin/python" -m pip install --progress-bar off "${PIP_QUIET[@]}" "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

# Import check: every piece the CPU recipe relies on. Run without PYTHONPATH so that
# only the environment itself counts.
import_check() {
  env -u PYTHONPATH OMP_NUM_THREADS=1 RELAX_REPO="$REPO" "$VENV/bin/python" - <<'PY'
import os, sys, time
t0 = time.time()
import torch
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
if torch.version.cuda is not None:
    print(f"  note: torch {torch.__version__} is a CUDA build (works on CPU, just larger)")
import torchvision.transforms  # noqa: F401  (fails without the guard)
from vllm._custom_ops import rotary_embedding  # noqa: F401  (the shim)
import sglang
from sglang import Engine  # noqa: F401
from sglang.srt.server_args import ServerArgs  # noqa: F401
assert sglang.__version__ == "0.5.23", sglang.__version__
import relax
want = os.path.realpath(os.path.join(os.environ["RELAX_REPO"], "relax"))
got = os.path.realpath(os.path.dirname(relax.__file__))
assert got == want, f"relax imports from {got}, expected {want}"
import hydra, omegaconf, transformers, pytest  # noqa: F401,E401
print(f"  python {sys.version.split()[0]}, torch {torch.__version__}, sglang {sglang.__version__}, "
      f"transformers {transformers.__version__}, relax from {got} ({time.time() - t0:.1f}s)")
PY
}

if [[ "$FORCE" == 1 && -e "$VENV" ]]; then
  [[ -f "$VENV/pyvenv.cfg" ]] || die "$VENV exists but is not a virtual environment; not deleting it"
  log "--force: removing $VENV"
  rm -rf "$VENV"
fi

if [[ -x "$VENV/bin/python" && -f "$STAMP_FILE" && "$(cat "$STAMP_FILE")" == "$STAMP" ]]; then
  log "found a finished build at $VENV; checking it"
  if import_check; then
    log "ready: $VENV (nothing to do)"
    exit 0
  fi
  log "the check failed; repairing in place"
fi
rm -f "$STAMP_FILE"

# 1. The environment itself, on Python 3.11 (the sglang wheel is cp311).
if [[ ! -x "$VENV/bin/python" ]]; then
  command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set PYTHON=/path/to/python3.11)"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "$PYTHON is not Python 3.11"
  log "creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
else
  log "reusing $VENV"
fi
"$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || die "$VENV is not Python 3.11; rerun with --force"

log "pip==$PIP_VERSION"
pip_install "pip==$PIP_VERSION"

# Every later pip step is held to this torch, so nothing can swap in a CUDA build.
TORCH_PIN="$VENV/relax-torch-constraint.txt"
echo "torch==$TORCH_VERSION" > "$TORCH_PIN"

# 2. torch first, on its own: pip picks the local CPU wheel over PyPI's CUDA build.
log "torch==$TORCH_VERSION (CPU wheel)"
pip_install "torch==$TORCH_VERSION"

# 3. The pinned set (SGLang's CPU-usable requirements + Relax's). Several minutes and
#    ~3.5 GB on an empty pip cache; seconds when everything is already there.
log "pinned requirements: $(grep -c '==' "$REQ") packages from ${REQ#"$REPO"/}"
pip_install -c "$TORCH_PIN" -r "$REQ"

# 4. SGLang itself, without its dependencies (see the header).
log "sglang==$SGLANG_VERSION (--no-deps)"
pip_install --no-deps "sglang==$SGLANG_VERSION"

# 5. torchvision guard.
log "guarding torchvision's register_fake calls"
"$VENV/bin/python" - <<'PY'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("torchvision")
if spec is None:
    sys.exit("torchvision is not installed")
path = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
src = path.read_text()
marker = "# relax-sglang-cpu: guarded"
if marker in src:
    print(f"  already guarded: {path}")
    sys.exit(0)
count = 0
for op in ("nms", "qnms"):
    old = f'@torch.library.register_fake("torchvision::{op}")\n'
    new = (f'@(torch.library.register_fake("torchvision::{op}") '
           f'if torchvision.extension._has_ops() else (lambda fn: fn))  {marker}\n')
    if old in src:
        src = src.replace(old, new)
        count += 1
if count != 2:
    sys.exit(f"unexpected layout of {path}: found {count} of the 2 register_fake calls")
path.write_text(src)
for pyc in (path.parent / "__pycache__").glob("_meta_registrations.*.pyc"):
    pyc.unlink()
print(f"  guarded 2 calls in {path}")
PY

# 6. The vllm._custom_ops shim, copied into site-packages and added via a .pth file
#    (appended to sys.path, so a real vllm, if ever installed, wins).
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
log "installing the rotary-embedding shim into $SITE"
rm -rf "$SITE/relax_sglang_cpu_shims"
mkdir -p "$SITE/relax_sglang_cpu_shims"
cp -r "$SHIMS/vllm" "$SITE/relax_sglang_cpu_shims/vllm"
find "$SITE/relax_sglang_cpu_shims" -name __pycache__ -prune -exec rm -rf {} +
echo "$SITE/relax_sglang_cpu_shims" > "$SITE/relax_sglang_cpu_shims.pth"

# 7. Relax itself, editable, without touching its pins; then the few extra packages it
#    needs, held to the same versions as above (normally all already present).
log "relax (editable, --no-deps) from $REPO"
pip_install --no-deps --no-build-isolation -e "$REPO"
log "relax's extra dependencies"
pip_install -c "$TORCH_PIN" -c "$REQ" hydra-core==1.3.8 omegaconf rich tqdm tensorboard \
  matplotlib pytest pytest-timeout peft==0.21.2 accelerate==1.15.0

log "import check"
import_check || die "the import check failed"
echo "$STAMP" > "$STAMP_FILE"
log "done: $VENV ($(du -sh "$VENV" 2>/dev/null | cut -f1)); use $VENV/bin/python"
