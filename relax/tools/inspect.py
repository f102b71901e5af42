"""`relax inspect <dump dir | replay dir | run dir>`: read saved rollout (and train) data.

Shows a per-rollout summary, one sample in full with its per-token log-probs (tool tokens,
loss_mask 0, shown as masked), and, where
train data exists, rollout and train data joined sample by sample: which rank trained it,
its advantage, and the trainer's log_probs against the engine's rollout_log_probs, with the
worst samples' per-token log-probs drawn in <dir>/plots/token_logprobs_<rollout>.png (--out DIR:
in DIR; a dir that cannot be written, such as a run on a read-only results disk, gets the
report and a note instead).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from relax.debug.run_data import train_rows
from relax.errors import ConfigError, ReplayError
from relax.files import safe_load
from relax.model import load_tokenizer
from relax.process import describe, read_status
from relax.replay import read_rollout
from relax.tools import token_views
from relax.tools.plots import figure_dir, out_dir

MAX_ROWS = 20  # longer runs: the first and last rollouts (all of them with --json)
VERSION_STYLES = ("cyan", "magenta", "yellow", "green", "blue", "red")  # by policy version, cycling


def find_rollout_files(root: Path) -> dict[int, Path]:
    """Rollout files in a dump/run dir (rollout_data/) or a plain replay directory."""
    root = Path(root)
    if not root.exists():
        raise ReplayError(f"{root}: no such file or directory")
    if root.is_file():
        return {read_rollout(root)[0]["rollout_id"]: root}
    folder = root / "rollout_data" if (root / "rollout_data").is_dir() else root
    found = {}
    for path in sorted(folder.glob("*.pt")):
        m = re.search(r"(\d+)\D*$", path.stem)
        if m:
            found[int(m.group(1))] = path
    return dict(sorted(found.items()))


def find_train_files(root: Path, rollout_id: int) -> list[Path]:
    folder = Path(root) / "train_data"
    return sorted(folder.glob(f"{rollout_id}_*.pt")) if folder.is_dir() else []


def summarize(rollout_id: int, samples: list[dict]) -> dict:
    n_tokens = sum(sum(s["loss_mask"]) for s in samples) or 1  # the model's (a tool's are masked)
    return {
        "rollout_id": rollout_id, "samples": len(samples),
        "mean_reward": sum(s["reward"] for s in samples) / len(samples),
        "mean_response_len": sum(s["response_length"] for s in samples) / len(samples),
        "max_response_len": max(s["response_length"] for s in samples),
        "truncation_rate": sum(s["status"] == "truncated" for s in samples) / len(samples),
        "mean_rollout_log_prob": sum(lp for s in samples for lp, m in zip(s["rollout_log_probs"],
                                                                          s["loss_mask"]) if m) / n_tokens,
        "masked_tokens": sum(s["response_length"] - sum(s["loss_mask"]) for s in samples),
    }


def join_train(root: Path, rollout_id: int) -> dict[int, dict]:
    """Sample index -> what the trainer computed for it, from every rank's train file."""
    joined = {}
    for path in find_train_files(root, rollout_id):
        data = safe_load(path)
        for row in train_rows(path):
            diffs = [abs(a - b) for a, b in zip(row["log_probs"], row["rollout_log_probs"])]
            joined[row["index"]] = {
                **row, "rank": data.get("rank"), "dp_rank": data.get("dp_rank"),
                "file": str(path), "max_abs_diff_vs_rollout": max(diffs, default=0.0)}
    return joined


def inspect(root: Path, rollout_id: int | None, sample_index: int, worst: int = 3,
            threshold: float = 0.1, out: Path | None = None) -> dict:
    """`worst` > 0: the plot of that many worst samples (tokens with |Δ| over `threshold` marked),
    into `out` (else <root>/plots, where it can be written)."""
    files = find_rollout_files(root)
    if not files:
        raise ReplayError(f"{root}: no rollout data (*.pt, or rollout_data/*.pt) found; a run saves it "
                          "with debug=dump (or debug.save_rollout_data=<dir>/{rollout_id}.pt)")
    summaries, manifest = [], None
    for rid, path in files.items():
        data, samples = read_rollout(path)
        manifest = manifest or data.get("manifest")
        summaries.append(summarize(rid, [s.to_dict() for s in samples]))
    chosen = rollout_id if rollout_id is not None else next(iter(files))
    if chosen not in files:
        raise ReplayError(f"{root}: no rollout {chosen} (have {min(files)}..{max(files)})")
    samples = [s.to_dict() for s in read_rollout(files[chosen])[1]]
    for s in samples:  # (MoE: thousands of expert ids; the per-layer agreement below says more)
        s.pop("routed_experts", None)
    if not 0 <= sample_index < len(samples):
        raise ReplayError(f"rollout {chosen} has samples 0..{len(samples) - 1}")
    train = join_train(root, chosen)
    sample = samples[sample_index]
    trained_tokens = sum(map(bool, sample["loss_mask"]))
    if sample_index in train and len(train[sample_index]["log_probs"]) != trained_tokens:
        raise ReplayError(f"{train[sample_index]['file']}: sample {sample_index} has "
                          f"{len(train[sample_index]['log_probs'])} per-token log_probs, but the rollout "
                          f"file {files[chosen]} gives it {trained_tokens} trained tokens: the files are "
                          f"truncated or from different runs")
    tokenizer = None
    if (Path(root) / "tokenizer").is_dir():  # a dump carries its tokenizer
        tokenizer = load_tokenizer(Path(root) / "tokenizer")
        response = sample["tokens"][len(sample["tokens"]) - sample["response_length"]:]
        sample = {**sample, "response_token_texts": tokenizer.convert_ids_to_tokens(response)}
    worst_samples = token_views.worst_samples(train, worst, tokenizer) if worst > 0 else []
    folder, note = figure_dir(out, Path(root) / "plots", "inspect") if worst_samples else (None, None)
    plot = token_views.plot(worst_samples, threshold, chosen, folder / f"token_logprobs_{chosen}.png") \
        if folder else None
    status = read_status(root) if Path(root).is_dir() else None
    routing = next((safe_load(p).get("routing_agreement_per_layer") for p in find_train_files(root, chosen)),
                   None)
    return {
        "root": str(root), "run_status": describe(status) if status else None,
        "routing_agreement_per_layer": routing,
        "manifest": manifest, "rollouts": summaries,
        "sample": {"rollout_id": chosen, **sample, "train": train.get(sample_index)},
        "train_join": {
            "rollout_id": chosen, "trained_samples": len(train),
            "untrained_samples": sorted(set(range(len(samples))) - set(train)),
            "ranks": sorted({row["dp_rank"] for row in train.values()}),
            "per_sample": [{"index": i, "dp_rank": row["dp_rank"], "rank": row["rank"],
                            "advantage": row["advantage"], "reward": row["reward"],
                            "max_abs_diff_vs_rollout": row["max_abs_diff_vs_rollout"]}
                           for i, row in sorted(train.items())],
            "worst_samples": [{k: w[k] for k in ("index", "max_abs_diff", "position", "token", "token_text",
                                                 "log_prob", "rollout_log_prob")}
                              | {"over_threshold": token_views.over_threshold(w, threshold)}
                              for w in worst_samples],
            "threshold": threshold, "token_plot": str(plot) if plot else None, "plot_note": note,
        } if train else None,
    }


def render(report: dict, console: Console) -> None:
    m = report["manifest"] or {}
    console.print(f"[bold]{report['root']}[/]  model {m.get('model_path')} "
                  f"(fingerprint {m.get('model_fingerprint')}), sampling {m.get('sampling')}")
    if report["run_status"]:  # a run dir: is it running, finished, or dead?
        console.print(f"run: {report['run_status']}", highlight=False)
    table = Table("rollout", "samples", "mean reward", "resp len (mean/max)", "truncated",
                  "mean rollout log-prob", "masked tokens", title="Rollouts")
    rows = report["rollouts"]
    shown = rows if len(rows) <= MAX_ROWS else rows[:MAX_ROWS // 2] + rows[-MAX_ROWS // 2:]
    for r in shown:
        table.add_row(str(r["rollout_id"]), str(r["samples"]), f"{r['mean_reward']:.3f}",
                      f"{r['mean_response_len']:.1f} / {r['max_response_len']}",
                      f"{r['truncation_rate']:.1%}", f"{r['mean_rollout_log_prob']:.4f}",
                      str(r["masked_tokens"]))
    console.print(table)
    if len(rows) > len(shown):
        console.print(f"({len(rows) - len(shown)} rollouts not shown; --json has all)")

    if report.get("routing_agreement_per_layer"):
        console.print(f"MoE routing, rollout {report['sample']['rollout_id']}: the trainer's experts equal "
                      f"the engine's on this share of (token, layer) pairs, per MoE layer")
        layers = Table("MoE layer", "agreement")
        for i, agreement in enumerate(report["routing_agreement_per_layer"]):
            layers.add_row(str(i), "-" if agreement is None else f"{agreement:.4f}")
        console.print(layers)

    s, train = report["sample"], report["sample"]["train"]
    console.print(f"\n[bold]Rollout {s['rollout_id']}, sample {s['index']}[/] (group "
                  f"{s['group_index']}): reward {s['reward']}, label {s['label']!r}, {s['status']}")
    console.print(f"prompt:   {s['prompt']!r}\nresponse: {s['response']!r}")
    response = s["tokens"][len(s["tokens"]) - s["response_length"]:]
    texts = s.get("response_token_texts") or [""] * len(response)
    versions = s.get("token_versions")
    if versions:  # partial rollouts: a response can span several policies
        console.print(by_version(response, texts, versions))
    columns = ["token", "loss_mask", "rollout_log_prob"] + (["log_prob", "ref_log_prob"] if train else []) + (
        ["policy_version"] if versions else [])
    tokens = Table(*columns)
    trained = 0  # train data holds the model's tokens only, in order
    for t, (tok, text) in enumerate(zip(response, texts)):
        token = f"{tok} {text!r}" if text else str(tok)
        version = [str(versions[t])] if versions else []
        if not s["loss_mask"][t]:  # a tool's or the environment's token: not trained on
            tokens.add_row(token, "0 masked", "-", *(["-", "-"] if train else []), *version, style="dim")
            continue
        row = [token, "1", f"{s['rollout_log_probs'][t]:.6f}"]
        if train:
            row += [f"{train['log_probs'][trained]:.6f}", f"{train['ref_log_probs'][trained]:.6f}"]
            trained += 1
        tokens.add_row(*row, *version, style=version_style(versions, t))
    console.print(tokens)

    join = report["train_join"]
    if join:
        console.print(f"\n[bold]Train data for rollout {join['rollout_id']}[/]: "
                      f"{join['trained_samples']} samples over dp ranks {join['ranks']}; "
                      f"untrained: {join['untrained_samples'] or 'none'}")
        worst = max(join["per_sample"], key=lambda r: r["max_abs_diff_vs_rollout"])
        console.print(f"largest |log_probs - rollout_log_probs|: {worst['max_abs_diff_vs_rollout']:.3g} "
                      f"(sample {worst['index']}, dp rank {worst['dp_rank']})")
        if join["worst_samples"]:
            console.print(f"worst samples by max |log_probs - rollout_log_probs| (tokens over "
                          f"{join['threshold']:g} marked): {join['token_plot'] or 'no plot'}",
                          highlight=False, soft_wrap=True)
            for w in join["worst_samples"]:
                console.print(f"  {token_views.describe(w)}", highlight=False, soft_wrap=True)
            if join["plot_note"]:
                console.print(join["plot_note"], highlight=False, soft_wrap=True)
        if train:
            console.print(f"sample {s['index']} was trained by dp rank {train['dp_rank']} "
                          f"(rank {train['rank']}) with advantage {train['advantage']:.4f}")


def version_style(versions: list[int] | None, t: int) -> str | None:
    return VERSION_STYLES[(versions[t] - min(versions)) % len(VERSION_STYLES)] if versions else None


def by_version(response: list[int], texts: list[str], versions: list[int]) -> Text:
    """The response's tokens coloured by the policy version that sampled each, with a legend."""
    line = Text("by policy version (")
    for i, v in enumerate(sorted(set(versions))):
        line.append(f"{', ' if i else ''}v{v}", style=version_style(versions, versions.index(v)))
    line.append("): ")
    for t, (tok, text) in enumerate(zip(response, texts)):
        line.append(text or f"<{tok}>", style=version_style(versions, t))
    return line


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="relax inspect", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="dump dir, run dir, replay dir or one rollout file")
    ap.add_argument("--rollout", type=int, default=None, help="rollout to show in detail")
    ap.add_argument("--sample", type=int, default=0, help="sample index to show in full")
    ap.add_argument("--worst", type=int, default=3, metavar="K",
                    help="plot the K samples with the largest max |log_probs - rollout_log_probs| (0: none)")
    ap.add_argument("--threshold", type=float, default=0.1, help="mark tokens whose |Δ| is over this")
    ap.add_argument("--out", type=out_dir, metavar="DIR",
                    help="where the worst samples' plot goes (default: <path>/plots, when it can be written; "
                         "else it is skipped with a note, the report printed all the same)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    try:
        report = inspect(args.path, args.rollout, args.sample, args.worst, args.threshold, args.out)
    except (ReplayError, ConfigError) as e:
        print(f"relax inspect: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        render(report, Console(width=None if sys.stdout.isatty() else 160))  # piped: no wrapped headers
    return 0
