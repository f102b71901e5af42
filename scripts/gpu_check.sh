#!/usr/bin/env bash
# The one-script GPU check (docs/gpu-check.md): on a machine with one NVIDIA GPU, from a
# clean clone, install what Relax needs on GPUs and run the checks of scripts/gpu_check.py.
#
#   scripts/gpu_check.sh                   # install into .venv-gpu, then run every check
#   scripts/gpu_check.sh --dry-run         # no GPU, no install: configs compose, commands parse
#   scripts/gpu_check.sh --out FILE        # the JSON of results (default gpu_check_results.json)
#
# Environment variables:
#   PYTHON              interpreter: for --dry-run, one with Relax installed (default python3);
#                       otherwise the one the environment is built from (python3.12 or python3.11)
#   RELAX_GPU_VENV      where the environment lives (default: <repo>/.venv-gpu; reused if built)
#   RELAX_GPU_WHEELS    a directory of wheels to install from instead of PyPI (offline machines)
#   CUDA_HOME           the CUDA 13 toolkit Transformer Engine's PyTorch extension compiles
#                       against when no prebuilt wheel matches torch (default /usr/local/cuda)
# After them, the true-on-policy check: `relax rollout=sglang rollout.true_on_policy=true` (SGLang's
# deterministic inference, the torch trainer's batch-invariant forward) on the tiny model in
# bf16, whose train vs rollout mismatch must be exactly 0 at every step; its result goes into
# the JSON as `sglang_true_on_policy` (docs/debugging.md, "Train vs rollout").
# Exit code: 0 when every check passed, 1 when one failed, 2 when the machine or install is unfit.
set -euo pipefail

TE_VERSION=2.11.0  # megatron-core 0.16.1's dev extra asks for transformer-engine >=2.9,<2.12
TE_BUILD=(setuptools==84.2.1 wheel==0.48.0 ninja==1.13.2 pybind11==3.1.0)  # its extension's build
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RELAX_GPU_VENV:-$REPO/.venv-gpu}"
START=$SECONDS
log() { printf '[gpu-check %4ss] %s\n' "$((SECONDS - START))" "$*"; }
die() { log "ERROR: $*" >&2; exit 2; }

DRY_RUN=0
OUT="$PWD/gpu_check_results.json"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --out) [[ $# -ge 2 ]] || die "--out needs a file"; OUT="$(realpath -m "$2")"; shift ;;
    -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
  shift
done

bash -n "${BASH_SOURCE[0]}"  # this script parses (the dry run's first check)
if [[ "$DRY_RUN" == 1 ]]; then
  exec "${PYTHON:-python3}" "$REPO/scripts/gpu_check.py" --dry-run --out "$OUT"
fi

# 1. The machine: a driver and a GPU.
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this check needs an NVIDIA GPU and its driver"
log "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"

# 2. The environment: CUDA torch, SGLang, Megatron-core and Relax's own dependencies (uv
#    resolves and downloads in parallel: minutes instead of pip's quarter of an hour).
if [[ -z "${PYTHON:-}" ]]; then
  PYTHON="$(command -v python3.12 || command -v python3.11 || true)"
fi
[[ -n "$PYTHON" ]] && "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] not in ((3, 11), (3, 12)))' \
  || die "needs Python 3.11 or 3.12 (set PYTHON=/path/to/python3.12)"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
INDEX=()
[[ -n "${RELAX_GPU_WHEELS:-}" ]] && INDEX=(--no-index --find-links "$RELAX_GPU_WHEELS")
"$VENV/bin/python" -m pip install -q "${INDEX[@]}" uv==0.13.9 || die "could not install uv"
install() { "$VENV/bin/uv" pip install --python "$VENV/bin/python" "${INDEX[@]}" "$@"; }
log "installing torch, SGLang, Megatron-core (scripts/gpu-requirements.txt)"
install -q -r "$REPO/scripts/gpu-requirements.txt" || die "the install failed"
install -q --no-deps -e "$REPO" || die "installing Relax failed"
"$VENV/bin/python" -c 'import torch, sglang, megatron.core, relax; assert torch.cuda.is_available()' \
  || die "the environment does not import, or torch sees no GPU"

# 3. Transformer Engine, in the background (its PyTorch extension may compile for minutes)
#    while the SGLang checks run; gpu_check.py waits for it before Megatron starts.
TE_LOG="${OUT%.json}.te-install.log"
TE_RC="${OUT%.json}.te-install.rc"
rm -f "$TE_RC"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" NVTE_FRAMEWORK=pytorch MAX_JOBS="${MAX_JOBS:-16}"
( if "$VENV/bin/python" -c 'import transformer_engine.pytorch' 2>/dev/null; then echo 0; else
    { install "${TE_BUILD[@]}" && install --no-build-isolation \
        "transformer-engine[pytorch,core_cu13]==$TE_VERSION"; } >"$TE_LOG" 2>&1
    echo $?; fi >"$TE_RC.tmp" && mv "$TE_RC.tmp" "$TE_RC" ) &
log "Transformer Engine $TE_VERSION installing in the background (log: $TE_LOG)"

# 4. The checks.
log "running the checks"
cd "$REPO"
status=0
"$VENV/bin/python" scripts/gpu_check.py --out "$OUT" --te-rc "$TE_RC" || status=$?
wait

# 5. True on-policy with SGLang: every step's train vs rollout mismatch exactly 0.
TOP_RUN="$(dirname "$OUT")/gpu_check_true_on_policy"
log "true on-policy: relax rollout=sglang rollout.true_on_policy=true (run dir $TOP_RUN)"
"$VENV/bin/python" -m relax rollout=sglang rollout.true_on_policy=true model.dtype=bfloat16 \
  rollout.num_rollout=3 checkpoint.save_interval=null hydra.run.dir="$TOP_RUN" >"$TOP_RUN.log" 2>&1 || true
"$VENV/bin/python" - "$TOP_RUN" "$OUT" <<'PY' || status=1
import json, sys
from pathlib import Path
run, out = Path(sys.argv[1]), Path(sys.argv[2])
keys = ("train/train_rollout_logprob_abs_diff", "train/mismatch_kl")
metrics = run / "metrics.jsonl"
steps = [m for m in map(json.loads, metrics.read_text().splitlines()) if keys[0] in m] if metrics.is_file() else []
passed = len(steps) == 3 and all(m[k] == 0.0 for m in steps for k in keys)
result = {"status": "PASS" if passed else "FAIL", "run_dir": str(run), "steps": [{k: m[k] for k in keys} for m in steps]}
if not steps:
    result["error"] = f"no training step: see {run}.log"
results = json.loads(out.read_text()) if out.is_file() else {}
results.setdefault("checks", {})["sglang_true_on_policy"] = result
out.write_text(json.dumps(results, indent=2))
print(f"[gpu-check] {result['status']} sglang_true_on_policy", json.dumps(result["steps"] or result.get("error")))
sys.exit(0 if passed else 1)
PY
log "done in $((SECONDS - START)) s: $OUT"
exit "$status"
