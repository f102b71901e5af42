"""Where two runs part, layer by layer: the layer dump (debug.dump_layers) read and judged,
for `relax compare --layers` (relax/tools/layers.py) and the doctor's layer hints.

How it works in detail: docs/debugging.md, "Inside `relax/debug/layers.py`".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relax.debug.verdicts import over, scaled_floor
from relax.files import read_json, safe_load
from relax.train.layer_dump import FORMAT_VERSION, LOG_PROBS

# -- compare ----------------------------------------------------------------------------------

EPS = {
    "float32": torch.finfo(torch.float32).eps,
    "bfloat16": torch.finfo(torch.bfloat16).eps,
    "float16": torch.finfo(torch.float16).eps,
}


@dataclass
class Dump:
    path: Path
    manifest: dict
    forward: dict[str, list[torch.Tensor]]
    log_probs: list[torch.Tensor]
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]

    @property
    def name(self) -> str:
        return self.manifest.get("name", self.path.parent.name)


def load_dump(path: Path) -> Dump:
    """A layer dump, or ValueError naming the file and what is wrong with it."""
    data = safe_load(path, mmap=True)  # (a real model's dump is ~1 GB of weights and gradients)
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: not a Relax layer dump of format {FORMAT_VERSION} "
                         f"(format_version {data.get('format_version') if isinstance(data, dict) else '?'})")
    missing = [k for k in ("manifest", "forward", LOG_PROBS, "grads", "params") if k not in data]
    if missing:
        raise ValueError(f"{path}: layer dump without {', '.join(missing)}")
    return Dump(path, data["manifest"], data["forward"], data[LOG_PROBS], data["grads"], data["params"])


def check(a: Dump, b: Dump) -> None:
    """ValueError saying why two dumps cannot be compared (the manifest check before any number)."""
    why = [f"{key}: {a.manifest.get(key)} in {a.path} vs {b.manifest.get(key)} in {b.path}"
           for key in ("model_fingerprint", "samples", "rollout_id")
           if a.manifest.get(key) != b.manifest.get(key)]
    if why:
        raise ValueError("layer dumps that cannot be compared: " + "; ".join(why))


def rel_diff(a, b) -> float:
    """||a - b|| / ||b|| over one tensor or a list of per-sample tensors (inf: shapes differ)."""
    a, b = (a, b) if isinstance(a, list) else ([a], [b])
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf
    # differences in (at least) fp32, exact for values within 2x of each other; norms summed in
    # fp64 (without fp64 copies of ~1 GB of a real model's weights and gradients)
    wide = [torch.promote_types(y.dtype, torch.float32) for y in b]
    num = math.hypot(*(float(torch.linalg.vector_norm(x.to(w) - y.to(w), dtype=torch.float64))
                       for x, y, w in zip(a, b, wide)))
    den = math.hypot(*(float(torch.linalg.vector_norm(y.to(w), dtype=torch.float64))
                       for y, w in zip(b, wide)))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def holding(squared: torch.Tensor, share: float) -> int:
    """How many of the largest elements of `squared` (>= 0, fp64) hold `share` of its sum (0 if
    it is 0). Sorting a real model's embedding (tens of millions of elements) is slow
    (docs/results.md), so the elements go into bins of 1/16 of a power of two, summed per bin from the largest down, and only the
    bin where `share` is reached is sorted."""
    positive = squared[squared > 0]
    if not len(positive):
        return 0
    target = share * float(positive.sum())
    bins = torch.floor(torch.log2(positive) * 16).long()
    bins = int(bins.max()) - bins  # 0: the largest values' bin
    sums = torch.zeros(int(bins.max()) + 1, dtype=torch.float64).index_add_(0, bins, positive)
    reached = sums.cumsum(0)
    last = min(int(torch.searchsorted(reached, target)), len(sums) - 1)  # the bin `share` is reached in
    before = float(reached[last - 1]) if last else 0.0
    inside = positive[bins == last].sort(descending=True).values.cumsum(0)
    return int((bins < last).sum()) + min(int(torch.searchsorted(inside, target - before)) + 1, len(inside))


def spread(a, b, share: float = 0.9) -> dict | None:
    """How a's difference from b lies over the elements of one tensor or a list of per-sample
    tensors: how many of the `total` elements hold `share` of ||a - b||^2 (`elements`) and of
    ||b||^2 (`own`: a difference spread like the tensor itself is a scale, one far narrower is
    local), and the largest difference (`at`: its index, [sample, ...] for a list; `values`: a's
    and b's there). None where the shapes differ."""
    listed = isinstance(a, list)
    a, b = (a, b) if listed else ([a], [b])
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return None
    flat = [(x.float() - y.float()).reshape(-1) for x, y in zip(a, b)]
    squared = torch.cat(flat).double() ** 2
    out = {"elements": holding(squared, share), "total": len(squared), "share": share,
           "own": holding(torch.cat([y.reshape(-1) for y in b]).double() ** 2, share)}
    if out["elements"] == 0:
        return {**out, "at": None, "values": None}
    k, worst = 0, int(squared.argmax())  # (tensor k of the list, its element)
    while worst >= flat[k].numel():
        worst -= flat[k].numel()
        k += 1
    at = [int(i) for i in torch.unravel_index(torch.tensor(worst), a[k].shape)]
    return {**out, "at": [k, *at] if listed else at,
            "values": [float(a[k].reshape(-1)[worst]), float(b[k].reshape(-1)[worst])]}


# Within a decoder layer, the order its parameters' gradients are computed in (backward runs
# from the MLP's output back to the attention's input); names not listed come last.
BACKWARD_IN_LAYER = ("mlp.down_proj", "mlp.up_proj", "mlp.gate_proj", "mlp.shared_expert_gate",
                     "mlp.shared_expert", "mlp.experts", "mlp.gate", "post_attention_layernorm",
                     "self_attn.o_proj", "self_attn.v_proj", "self_attn.k_proj", "self_attn.q_proj",
                     "self_attn.k_norm", "self_attn.q_norm", "input_layernorm")
LAYER_PARAM = re.compile(r"model\.layers\.(\d+)\.(.+)")


def backward_order(name: str) -> tuple:
    """Sort key of an HF parameter name in the order backward reaches it (output layer first,
    embedding last): the same for every backend, whatever order its dump holds them in."""
    m = LAYER_PARAM.match(name)
    if m:
        within = next((i for i, p in enumerate(BACKWARD_IN_LAYER) if m[2].startswith(p)),
                      len(BACKWARD_IN_LAYER))
        return (2, -int(m[1]), within, m[2])
    head = 0 if name.startswith("lm_head") else 1 if name.startswith("model.norm") else 3
    return (head, 0, 0, name)


def diffs(a: Dump, b: Dump) -> dict[str, dict[str, float]]:
    """Per part (forward, grads, params), per tensor in its order (forward order; backward
    order for gradients), a's relative difference from b; a tensor only one side has is inf."""
    forward, ours = tensors(b, "forward"), tensors(a, "forward")
    out = {"forward": {n: rel_diff(ours[n], forward[n]) if n in ours else math.inf for n in forward}}
    for part in ("grads", "params"):
        theirs, mine = getattr(b, part), getattr(a, part)
        names = sorted(theirs, key=backward_order, reverse=part == "params")  # weights: forward order
        out[part] = {n: rel_diff(mine[n], theirs[n]) if n in mine else math.inf
                     for n in names} if mine else {}
    return out


@dataclass
class Departure:
    job: str
    diffs: dict[str, dict[str, float]]
    floors: dict[str, dict[str, float]]
    # part -> (name, rel, floor) of its first tensor above the floor
    first: dict[str, tuple[str, float, float] | None] = field(default_factory=dict)
    spreads: dict[str, dict | None] = field(default_factory=dict)  # part -> spread() of its first
    note: str = ""  # what was not compared

    @property
    def departs(self) -> bool:
        return any(v is not None for v in self.first.values())

    def locate(self, a: Dump, b: Dump) -> None:
        """The spread of each part's first departing tensor, a's against b's (None: a lacks it)."""
        for part, first in self.first.items():
            if first is not None:
                mine, theirs = tensors(a, part), tensors(b, part)
                self.spreads[part] = spread(mine[first[0]], theirs[first[0]]) if first[0] in mine else None

    def line(self) -> str:
        what = {"forward": "forward departs at", "grads": "gradients depart at",
                "params": "weights depart at"}
        parts = [f"{what[p]} {n} (rel {r:.1e}, floor {f:.1e}{describe(self.spreads.get(p))})"
                 for p, v in self.first.items() if v for n, r, f in [v]]
        said = "; ".join(parts) if parts else "departs nowhere"
        return f"{self.job}: {said}" + (self.note and f" ({self.note})")


def tensors(dump: Dump, part: str) -> dict:
    """A dump's tensors of one part by name (forward: the module outputs and the log-probs)."""
    return {**dump.forward, LOG_PROBS: dump.log_probs} if part == "forward" else getattr(dump, part)


def describe(where: dict | None) -> str:
    """A spread, as the departure line's tail."""
    if not where or where["at"] is None:
        return ""
    a, b = where["values"]
    return (f"; {where['share']:.0%} of it in {where['elements']} of {where['total']} elements (of the "
            f"tensor itself: {where['own']}), the largest at [{', '.join(map(str, where['at']))}]: "
            f"{a:.6g} vs {b:.6g}")


def twin_noise(apart: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per part and tensor, the largest difference any twin (`apart`: each twin's diffs()) has
    from the baseline: the measured rounding noise. A difference that is not finite (a NaN, a
    tensor the twin lacks) measures none, as the step comparison drops a twin with NaN metrics."""
    noise: dict[str, dict[str, float]] = {}
    for d in apart:
        for part, values in d.items():
            measured = noise.setdefault(part, {})
            for n, v in values.items():
                if math.isfinite(v):
                    measured[n] = max(v, measured.get(n, 0.0))
    return noise


def judge_layers(job: str, d: dict[str, dict[str, float]], fixed: float, margin: float,
                 noise: dict[str, dict[str, float]] | None, unmeasured: float | None = None) -> Departure:
    """The first tensor of each part whose difference leaves its floor: max(fixed, margin x its
    `noise` (twin_noise())), or `unmeasured` (default: fixed) where no twin measured it. A
    difference that is not finite departs whatever the floor (a tensor only one side has: inf)."""

    noise = noise or {}
    floors = {part: {n: scaled_floor(fixed, noise[part][n], margin) if n in noise.get(part, {})
                     else unmeasured or fixed for n in values} for part, values in d.items()}
    dep = Departure(job, d, floors)
    for part, values in d.items():
        dep.first[part] = next(((n, v, floors[part][n]) for n, v in values.items()
                                if not math.isfinite(v) or over(v, floors[part][n])), None)
    return dep


def judge_sweep(names: list[str], apart: list[dict[str, dict[str, float]]], twins: list[int], fixed: float,
                margin: float) -> list[Departure]:
    """Each job's departure (`apart`: its diffs(); `twins`: which jobs are noise twins). A twin is
    the noise the others are judged against, so it is judged against the other twins' (twins
    that disagree by more than the margin are named); where no other twin measured a tensor (a
    lone twin: every tensor) it departs only at a difference that is not finite."""
    noise = twin_noise([apart[k] for k in twins])
    return [judge_layers(name, d, fixed, margin, twin_noise([apart[i] for i in twins if i != k]), math.inf)
            if k in twins else judge_layers(name, d, fixed, margin, noise)
            for k, (name, d) in enumerate(zip(names, apart, strict=True))]


# -- relax compare --layers -------------------------------------------------------------------


def dump_dir_of(run: Path) -> Path:
    """The layer dump dir a run wrote (built.json), or ValueError saying how to make one."""

    built = read_json(run / "built.json") if (run / "built.json").is_file() else {}
    if not built.get("dump_layers"):
        raise ValueError(f"{run}: no layer dump (run it with debug=dump or debug.dump_layers=<dir>)")
    return Path(built["dump_layers"])


def load_source(run: Path, source: str, rollout_id: int | None) -> Dump:
    """The run's `source` dump of `rollout_id` (default: its first dumped rollout)."""
    directory = dump_dir_of(run)
    found = sorted((int(p.name.split("_")[0]), p) for p in directory.glob(f"*_{source}.pt")
                   if p.name.split("_")[0].isdigit())
    if rollout_id is not None:
        found = [(i, p) for i, p in found if i == rollout_id]
    if not found:
        which = f"rollout {rollout_id}" if rollout_id is not None else "any rollout"
        raise ValueError(f"{run}: no {source} layer dump of {which} in {directory}")
    dump = load_dump(found[0][1])
    dump.manifest.setdefault("name", run.name)
    return dump


def floor_fixed(dump: Dump, eps_multiple: float) -> float:
    """The floor without a twin: `eps_multiple` x the epsilon of the baseline's dtype."""
    return eps_multiple * EPS.get(str(dump.manifest.get("dtype", "float32")), EPS["float32"])


def within_run(run: Path, rollout_id: int | None, eps_multiple: float,
               margin: float) -> tuple[list[Departure], str]:
    """One run: its engine's and its reference model's forward against its trainer's, on the
    same sequences (an engine that recorded no module outputs is compared on its log-probs)."""
    base = load_source(run, "train", rollout_id)
    deps, fixed = [], floor_fixed(base, eps_multiple)
    for source in ("engine", "ref"):
        if not any(dump_dir_of(run).glob(f"{base.manifest['rollout_id']}_{source}.pt")):
            continue
        other = load_source(run, source, base.manifest["rollout_id"])
        check(other, base)
        d = diffs(other, base)
        if not other.forward:  # (rollout=sglang: docs/debugging.md)
            d["forward"] = {LOG_PROBS: d["forward"][LOG_PROBS]}
        deps.append(judge_layers(source, d, fixed, margin, None))
        deps[-1].note = "" if other.forward else "log-probs only: the engine recorded no module outputs"
        deps[-1].locate(other, base)
    if not deps:
        raise ValueError(f"{run}: a trainer layer dump, but no engine or reference dump to compare it with")
    return deps, f"{run.name}: engine and reference against the trainer"


def runs_of(paths: list[Path]) -> list[Path]:
    """The run dirs to compare: the given ones, or a multirun dir's jobs in launch order."""
    if len(paths) > 1 or (paths[0] / "built.json").is_file():
        return paths
    jobs = sorted((p for p in paths[0].iterdir() if (p / "built.json").is_file()),
                  key=lambda p: (p / "built.json").stat().st_mtime)
    if not jobs:
        raise ValueError(f"{paths[0]}: neither a run dir nor a multirun dir (no built.json in it or its "
                         f"subdirs)")
    return jobs


def compare_runs(paths: list[Path], baseline: str | None, rollout_id: int | None, eps_multiple: float,
                 margin: float) -> tuple[list[Departure], str]:
    """Departures of each job from the baseline (a sweep dir's jobs against --baseline, else its
    `single` job; runs A B ..: each against A, or --baseline), or of one run's engine from its
    trainer, and what was compared with what."""
    runs = runs_of(paths)
    if len(runs) == 1:
        return within_run(runs[0], rollout_id, eps_multiple, margin)

    layout = {r: read_json(r / "built.json").get("parallel") for r in runs}
    if baseline is not None:
        base_run = next((r for r in runs if baseline in (r.name, layout[r])), None)
        if base_run is None:
            raise ValueError(f"--baseline {baseline!r}: no such job "
                             f"(jobs: {', '.join(r.name for r in runs)})")
    else:  # a sweep: its single job; runs A B ...: A
        base_run = next((r for r in runs if layout[r] == "single"), runs[0]) if len(paths) == 1 else runs[0]
    base = load_source(base_run, "train", rollout_id)
    others = [load_source(r, "train", base.manifest["rollout_id"]) for r in runs if r != base_run]
    for dump in others:
        check(dump, base)
    apart = [diffs(d, base) for d in others]  # once per job: each reads both dumps whole
    twins = [k for k, d in enumerate(others) if d.manifest.get("noise_ulp")
             and d.manifest.get("backend") == base.manifest.get("backend")]
    deps = judge_sweep([d.name for d in others], apart, twins, floor_fixed(base, eps_multiple), margin)
    for dep, dump in zip(deps, others, strict=True):
        dep.locate(dump, base)
    names = ", ".join(others[k].name for k in twins)
    noise = (f"noise twin {names} (itself judged on NaN/Inf and missing tensors only: a second twin, "
             f"parallel=twin2, judges it by size)" if len(twins) == 1 else
             f"noise twins {names} (each also judged against the others)" if twins else
             f"no noise twin: floor {eps_multiple:g} x eps")
    return deps, f"baseline {base.name}, rollout {base.manifest['rollout_id']}; {noise}"
