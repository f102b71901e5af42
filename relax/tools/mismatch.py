"""`relax mismatch <run dir>`: why the trainer's log-probs differ from the engine's.

On a run's dumped train data (debug=dump) it rebuilds the engine's side of one rollout (the
run's torch engine class, teacher-forced through its own KV-cache decode, the rollout's samples
in one batch) and switches one factor at a time to the trainer's side; each factor's share is
how much of the gap that one switch closes. DESCRIPTION below; docs/debugging.md, "relax mismatch".
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from relax.debug.run_data import train_rows
from relax.errors import ConfigError, ReplayError
from relax.files import read_json, save_figure
from relax.logger import read_metrics
from relax.model import load_tokenizer
from relax.rollout.spec import EngineSpec
from relax.sample import log_prob_temperature
from relax.tools.mismatch_factors import (ROUTING, TOKENIZATION, Factor, recorded_experts, retokenized,
                                          routing_factor, tokenization_factor)
from relax.tools.mismatch_scoring import Scorer
from relax.tools.plots import figure_dir, out_dir, pyplot

DESCRIPTION = """`relax mismatch <run dir>`: explains a non-zero train vs rollout log-prob mismatch.

The mismatch is mean |log_prob - rollout_log_prob| over a rollout's trained tokens (what
train/train_rollout_logprob_abs_diff logs). From the run's dumps (debug=dump: train data, the
tokenizer, the config; checkpoints for the weights' version) it rebuilds the engine's log-probs
(the run's torch engine class, teacher-forced through its KV-cache decode, the rollout's samples
in one batch as the engine generated them) and switches one factor at a time to the trainer's
side. A factor's share is the part of the gap that switching it alone closes (they need not add
up to 100%); largest first, with the config key that changes it:

  engine dtype     rollout.dtype vs model.dtype: the engine recomputed in the trainer's dtype
  KV-cache decode  the engine's decode path vs one full forward per sample (rollout.true_on_policy)
  batch            each sample scored alone (engine and trainer) vs in its batch
  logits           the temperature / top-p the engine's log-probs match vs rollout.temperature
                   as the trainer scores it (found by search when the config does not reproduce them)
  weights          the weights the engine's log-probs match (the initial model or a checkpoint)
                   vs the trainer's at this step: a sync that did not land, train.async staleness
  MoE routing      the engine's recorded experts (the dump's rollout data) replayed in the
                   trainer's forward vs its own routers (algo.routing_replay)
  tokenization     each engine call's context as text re-encoded (an engine fed text) vs the
                   trained ids; counts the model turns whose ids are not their text re-encoded

Not covered: SGLang's kernels (the torch engine stands in for SGLang's). Writes
mismatch_<rollout>.png (per token) next to the run or into --out DIR.
"""

NOT_COVERED = ["SGLang's kernels (the torch engine stands in for them)"]

GRID = [round(0.05 * k, 2) for k in range(2, 61)]  # temperatures searched: 0.1 .. 3.0


@dataclass
class Report:
    run: str
    rollout_id: int
    tokens: int
    mismatch: float           # mean |log_prob - rollout_log_prob| (the dumps)
    replica_error: float      # mean |engine replica - rollout_log_prob|: how well the engine is rebuilt
    trainer_error: float      # mean |trainer recomputed alone - log_prob|
    engine: str
    factors: list[Factor]
    stand_in: str | None
    not_covered: list[str]
    cure: str | None = None
    plot: str | None = None


# -- the run's data ------------------------------------------------------------------------

def pick_rollout(run_dir: Path, dump: Path, wanted: int | None) -> int:
    have = sorted({int(p.stem.split("_")[0]) for p in (dump / "train_data").glob("*_*.pt")})
    if not have:
        raise ReplayError(f"{dump}: no train data (run with debug=dump, or debug.save_train_data)")
    if wanted is not None:
        if wanted not in have:
            raise ReplayError(f"no train data of rollout {wanted} in {dump / 'train_data'} (rollouts {have})")
        return wanted
    _, steps = read_metrics(run_dir)
    diffs = {s.get("rollout_id"): s["train/train_rollout_logprob_abs_diff"] for s in steps
             if s.get("step", 0) == 0 and "train/train_rollout_logprob_abs_diff" in s}
    return max(have, key=lambda r: (diffs.get(r, -1.0), -r))  # the worst rollout; ties: the first


def read_rows(dump: Path, rollout_id: int) -> list[dict]:
    rows = [r for f in sorted((dump / "train_data").glob(f"{rollout_id}_*.pt")) for r in train_rows(f)]
    rows = sorted({r["index"]: r for r in rows}.values(), key=lambda r: r["index"])  # dp ranks, tp copies
    for r in rows:
        if not isinstance(r.get("tokens"), list) or not isinstance(r.get("loss_mask"), list):
            raise ReplayError(f"{dump}: train data without tokens and loss_mask (an older Relax's)")
    return rows


def weight_versions(run_dir: Path, model_path: Path, rollout_id: int) -> tuple[dict[str, Path], str | None]:
    """The weights the run had, oldest first ({"initial model": path, "after rollout k": hf dir}),
    up to the trainer's at `rollout_id`'s first step, and the trainer's label (None: not saved)."""
    versions = {"initial model": model_path}
    for ckpt in sorted((run_dir / "checkpoints").glob("rollout_*")):
        k = int(ckpt.name.split("_")[1])
        if k < rollout_id and (ckpt / "hf" / "config.json").is_file():
            versions[f"after rollout {k}"] = ckpt / "hf"
    first = min((int(p.stem.split("_")[0]) for p in (run_dir / "train_data").glob("*_*.pt")), default=0)
    trainer = "initial model" if rollout_id <= first else f"after rollout {rollout_id - 1}"
    return versions, trainer if trainer in versions else None


# -- attribution ---------------------------------------------------------------------------

def explain(run_dir: Path, rollout: int | None = None) -> Report:
    run_dir = Path(run_dir)
    built = read_json(run_dir / "built.json") if (run_dir / "built.json").is_file() else {}
    own = (run_dir / "train_data").is_dir()
    dump = run_dir if own or not built.get("dump_dir") else Path(built["dump_dir"])
    config = next((c for c in (run_dir / ".hydra" / "config.yaml", dump / "config.yaml") if c.is_file()), None)
    if config is None:
        raise ReplayError(f"{run_dir}: no composed config (.hydra/config.yaml or a dump's config.yaml)")
    cfg = OmegaConf.load(config)
    model_path = Path(built.get("model_path") or "")
    if not (model_path / "config.json").is_file():
        raise ReplayError(f"{run_dir}: the run's model ({model_path}) is not on this machine (built.json's model_path)")
    rollout_id = pick_rollout(run_dir, dump, rollout)
    rows = read_rows(dump, rollout_id)
    tokenizer = load_tokenizer(dump / "tokenizer" if (dump / "tokenizer").is_dir() else model_path)
    trained = torch.tensor([x for r in rows for x in r["log_probs"]], dtype=torch.float64)
    rollout_lp = torch.tensor([x for r in rows for x in r["rollout_log_probs"]], dtype=torch.float64)
    mismatch = float((trained - rollout_lp).abs().mean())

    spec = EngineSpec.of(cfg.rollout, cfg.model, cfg.seed, model_path, [tokenizer.eos_token_id],
                         tokenizer.pad_token_id)
    scorer = Scorer(cfg.rollout, spec, rows, tokenizer)  # the trained ids (and every engine built)
    r = cfg.rollout
    t_cfg = log_prob_temperature(float(r.temperature))
    train_dtype, eng_dtype = str(cfg.model.dtype), str(r.dtype or cfg.model.dtype)
    versions, trainer_version = weight_versions(dump if own else run_dir, model_path, rollout_id)
    gap = lambda x: float((x.double() - trained).abs().mean())  # noqa: E731
    rep = lambda x: float((x.double() - rollout_lp).abs().mean())  # noqa: E731

    # the engine's weights: the version (the trainer's, and up to two before it) its log-probs match
    candidates = list(versions)
    if trainer_version:
        candidates = candidates[:candidates.index(trainer_version) + 1]
    candidates = candidates[-3:]
    # the engine's tokens: the trained ids, or (an engine fed text) each call's context re-encoded
    view, seen = retokenized(tokenizer, rows), scorer
    if view.changed:
        probe, text = scorer.engine(versions[candidates[-1]]), Scorer(r, spec, view.rows, tokenizer)
        x = {"x": (t_cfg, 1.0)}
        if rep(text.decode(probe, x)["x"]) < 0.5 * rep(scorer.decode(probe, x)["x"]):
            seen = text
    scored = {}
    for label in candidates:
        engine = scorer.engine(versions[label])
        variants = {("t", t): (t, 1.0) for t in sorted({*GRID, t_cfg, 1.0})}
        if float(r.top_p) < 1:
            variants["top_p"] = (t_cfg, float(r.top_p))
        scored[label] = (engine, seen.decode(engine, variants))
    engine_version = min(scored, key=lambda v: rep(scored[v][1][("t", t_cfg)]))
    engine, batch = scored[engine_version]
    # the logits processing its log-probs match: the config's, else the best of the search
    logits_key = ("t", t_cfg)
    best = min(batch, key=lambda k: rep(batch[k]))
    if rep(batch[best]) < 0.5 * rep(batch[logits_key]):
        logits_key = best
    e_temp, e_top_p = (t_cfg, float(r.top_p)) if logits_key == "top_p" else (logits_key[1], 1.0)
    engine_side = {"x": (e_temp, e_top_p)}
    replica = batch[logits_key]
    d0 = gap(replica)
    share = lambda x: max(0.0, min(1.0, 1 - gap(x) / d0)) if d0 > 0 else 0.0  # noqa: E731
    residual = lambda x: (x.double() - trained).abs().tolist()  # noqa: E731
    trainer_path = versions.get(trainer_version or engine_version)
    factors = []

    # engine dtype
    if eng_dtype != train_dtype:
        switched = seen.decode(scorer.engine(versions[engine_version], train_dtype), engine_side)["x"]
        factors.append(Factor("engine dtype", "rollout.dtype", eng_dtype, train_dtype, share(switched),
                              residual=residual(switched)))
    else:
        factors.append(Factor("engine dtype", "rollout.dtype", eng_dtype, train_dtype, 0.0,
                              "engine and trainer compute in one dtype"))
    # KV-cache decode vs a full forward
    switched = seen.decode(engine, engine_side, recompute=True)["x"]
    factors.append(Factor("KV-cache decode vs full forward", "rollout.true_on_policy", "KV-cache decode",
                          "full forward", share(switched), "the engine's own forward, the batch prefilled again "
                          "at each position", residual(switched)))
    # batch composition: each sample alone, on both sides (the trainer routing as it trained)
    experts, why = recorded_experts(model_path, dump, rollout_id, rows)
    replayed = cfg.algo.routing_replay == "rollout" and experts is not None
    alone = seen.decode(engine, engine_side, alone=True)["x"]
    trainer_alone, agree = scorer.full_forward(trainer_path, train_dtype, t_cfg, experts if replayed else None)
    trainer_error = float((trainer_alone.double() - trained).abs().mean())
    batch_share = max(0.0, min(1.0, 1 - float((alone.double() - trainer_alone.double()).abs().mean()) / d0)) \
        if d0 > 0 else 0.0
    factors.append(Factor("batch composition", "rollout.true_on_policy", "in its batch", "each sample alone",
                          batch_share, f"the trainer's own log-probs vs the sample scored alone: {trainer_error:.2e}",
                          residual=(alone.double() - trainer_alone.double()).abs().tolist()))
    # logits processing
    engine_says = f"temperature {e_temp:g}" + (f", top-p {e_top_p:g} renormalised" if e_top_p < 1 else "")
    switched = batch[("t", t_cfg)]
    note = "" if logits_key == ("t", t_cfg) else \
        f"the config says rollout.temperature={r.temperature}; the engine's log-probs match {engine_says}"
    factors.append(Factor("logits processing", "rollout.temperature / rollout.top_p", engine_says,
                          f"temperature {t_cfg:g}", share(switched), note, residual(switched)))
    # the weights' version
    if trainer_version is None:
        factors.append(Factor("weights' version", "the weight sync / train.async", engine_version, "not saved",
                              None, f"no checkpoint of rollout {rollout_id - 1}: run with checkpoint.save_interval=1 "
                                    "checkpoint.keep_last=null"))
    elif engine_version == trainer_version:
        factors.append(Factor("weights' version", "the weight sync / train.async", engine_version, trainer_version,
                              0.0, "the engine's log-probs match the trainer's weights"))
    else:
        switched = seen.decode(scorer.engine(versions[trainer_version]), engine_side)["x"]
        factors.append(Factor("weights' version", "the weight sync / train.async", engine_version, trainer_version,
                              share(switched), "a sync that did not land, or train.async's staleness",
                              residual(switched)))
    # MoE routing: the engine's recorded experts replayed in the trainer's forward
    factors.append(routing_factor(scorer, experts, why, replayed, trainer_path, train_dtype, t_cfg, replica,
                                  trainer_alone, agree))
    # tokenization: the engine fed each call's context as text re-encoded, vs the trained ids
    if seen is scorer:
        factors.append(tokenization_factor(view, False, 0.0, []))
    else:
        switched = scorer.decode(engine, engine_side)["x"]
        factors.append(tokenization_factor(view, True, share(switched), residual(switched)))
    factors.sort(key=lambda f: -1 if f.share is None else f.share, reverse=True)
    return Report(str(run_dir), rollout_id, len(trained), mismatch, rep(replica), trainer_error,
                  f"{type(engine).__module__}.{type(engine).__qualname__} ({eng_dtype}, {engine_version})",
                  factors, scorer.stand_in, NOT_COVERED, cure_of(factors[0], eng_dtype, train_dtype))


def cure_of(top: Factor, eng_dtype: str, train_dtype: str) -> str | None:
    """What removes the top factor, where one setting does."""
    if not top.share:
        return None
    if top.name in ("KV-cache decode vs full forward", "batch composition", "engine dtype"):
        return ("rollout.true_on_policy=true makes the mismatch exactly 0 where it comes from kernels "
                "(docs/true-on-policy.md)" + (f"; it needs one dtype: leave rollout.dtype null (model.dtype="
                                              f"{train_dtype})" if eng_dtype != train_dtype else ""))
    if top.name == ROUTING:
        return "algo.routing_replay=rollout (R3): the trainer routes every token to the engine's recorded experts"
    if top.name == TOKENIZATION:
        return ("feed the engine token ids, not text: build each call's prompt from the ids before it "
                "(rollout.generate_fn, docs/rollouts.md)")
    return None


# -- output --------------------------------------------------------------------------------

def as_text(report: Report) -> str:
    lines = [f"relax mismatch: rollout {report.rollout_id}: mean |log_prob - rollout_log_prob| = "
             f"{report.mismatch:.3g} over {report.tokens} trained tokens",
             f"engine rebuilt: {report.engine}; reproduces rollout_log_probs to {report.replica_error:.2g}",
             *([f"note: {report.stand_in}"] if report.stand_in else []),
             "", f"{'share':>7}  {'factor':<32} {'engine':<26} {'trainer':<20} key"]
    for f in report.factors:
        share = "   n/a" if f.share is None else f"{100 * f.share:6.1f}%"
        lines.append(f"{share}  {f.name:<32} {f.engine:<26} {f.trainer:<20} {f.key}")
        if f.note:
            lines.append(f"{'':9}{f.note}")
    top = report.factors[0]
    lines += ["", f"top factor: {top.name} ({top.key})" if top.share else "top factor: none explains it"]
    if report.replica_error > 0.5 * report.mismatch:
        lines.append("note: the rebuilt engine does not reproduce the engine's log-probs; part of the mismatch "
                     "comes from something not covered")
    if report.cure:
        lines.append(f"cure: {report.cure}")
    lines.append(f"not covered: {', '.join(report.not_covered)}")
    return "\n".join(lines)


def plot(report: Report, out: Path) -> None:
    plt = pyplot()
    fig, (ax, bars) = plt.subplots(2, 1, figsize=(10, 7))
    first = report.factors[0]
    gaps = [f for f in report.factors if f.residual]
    tiny = 1e-12
    ax.set_yscale("log")
    for f in gaps[:3]:
        ax.plot([max(x, tiny) for x in f.residual], ".", ms=3, label=f"|{f.name} switched - log_prob|")
    ax.set(title=f"rollout {report.rollout_id}: per trained token (top factor: {first.name})",
           xlabel="trained token", ylabel="|Δ log p|")
    ax.legend(fontsize=7)
    names = [f.name for f in report.factors][::-1]
    bars.barh(names, [100 * (f.share or 0) for f in report.factors][::-1])
    bars.set(xlabel="share of the mismatch (%)", xlim=(0, 100))
    fig.tight_layout()
    save_figure(fig, out, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="relax mismatch", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="a run dir made with debug=dump")
    ap.add_argument("--rollout", type=int, default=None,
                    help="which rollout (default: the dumped one with the largest step-0 mismatch)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--out", type=out_dir, metavar="DIR", help="where the plot goes (default: the run dir, "
                    "when it can be written; else it is skipped with a note)")
    args = ap.parse_args(argv)
    if not args.path.is_dir():
        print(f"relax mismatch: error: {args.path} is not a directory", file=sys.stderr)
        return 2
    try:
        report = explain(args.path, args.rollout)
    except (ReplayError, ConfigError) as e:
        print(f"relax mismatch: error: {e}", file=sys.stderr)
        return 2
    folder, note = figure_dir(args.out, args.path, "mismatch")
    if folder:
        name = f"mismatch_{report.rollout_id}.png"
        plot(report, folder / name)
        report.plot = str(folder / name)
    if args.json:
        data = asdict(report)
        for f in data["factors"]:
            f.pop("residual")
        print(json.dumps({**data, "note": note}))
    else:
        print(as_text(report))
        print(f"plot: {report.plot}" if report.plot else note)
    return 0
