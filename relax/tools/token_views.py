"""A rollout's worst samples, token by token: the train-vs-rollout picture of `relax inspect`.

From train data (debug.save_train_data; a dump's train_data/), the samples whose per-token
|log_probs - rollout_log_probs| reaches the largest maximum, and a PNG with one panel per
sample: its trained tokens along x (decoded with the dump's tokenizer/), the trainer's and
the engine's log-probs as two lines, and the tokens whose |Δ| is over a threshold marked.
"""

from __future__ import annotations

import math
from pathlib import Path

from relax.files import save_figure
from relax.tools.plots import pyplot

MAX_LABELS = 120  # tick labels per panel; a longer response labels every n-th token


def _magnitude(d: float) -> float:
    return math.inf if math.isnan(d) else d  # a NaN is the worst difference there is


def trained_token_ids(row: dict) -> list[int] | None:
    """The ids of a train row's trained tokens (its log-prob lists' positions), or None
    when the row's tokens and loss_mask do not give them."""
    tokens, mask = row.get("tokens"), row.get("loss_mask")
    if not (isinstance(tokens, list) and isinstance(mask, list) and len(mask) <= len(tokens)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
        return None
    ids = [t for t, m in zip(tokens[len(tokens) - len(mask):], mask) if m]
    return ids if len(ids) == len(row["log_probs"]) else None


def worst_samples(train: dict[int, dict], k: int, tokenizer=None) -> list[dict]:
    """The `k` samples with the largest max |Δ| (ties: the lower index), each with its trained
    tokens (ids, and texts with a tokenizer), both log-prob lists, and the token at the max."""
    out = []
    for index, row in train.items():
        diffs = [abs(a - b) for a, b in zip(row["log_probs"], row["rollout_log_probs"])]
        if not diffs:
            continue
        at = max(range(len(diffs)), key=lambda t: _magnitude(diffs[t]))
        ids = trained_token_ids(row)
        texts = [repr(tokenizer.decode([t]))[1:-1] for t in ids] if ids and tokenizer else None
        out.append({"index": index, "max_abs_diff": diffs[at], "position": at,
                    "token": ids[at] if ids else None, "token_text": texts[at] if texts else None,
                    "log_prob": row["log_probs"][at], "rollout_log_prob": row["rollout_log_probs"][at],
                    "token_ids": ids, "token_texts": texts, "log_probs": row["log_probs"],
                    "rollout_log_probs": row["rollout_log_probs"], "abs_diffs": diffs})
    out.sort(key=lambda r: (-_magnitude(r["max_abs_diff"]), r["index"]))
    return out[:k]


def over_threshold(sample: dict, threshold: float) -> list[int]:
    """Trained-token positions whose |Δ| is over `threshold` (NaN included)."""
    return [t for t, d in enumerate(sample["abs_diffs"]) if not d <= threshold]


def where(sample: dict) -> str:
    """The sample and its max |Δ|, with the token there: "sample 7: max |Δ| 0.21 at token 1 '4' (id 9)"."""
    token = "" if sample["token"] is None else (
        f" '{sample['token_text']}' (id {sample['token']})" if sample["token_text"] is not None
        else f" (id {sample['token']})")
    return (f"sample {sample['index']}: max |Δ| {sample['max_abs_diff']:.3g} at token "
            f"{sample['position']}{token}")


def describe(sample: dict) -> str:
    """One line: `where`, with both log-probs there."""
    return f"{where(sample)}: log_prob {sample['log_prob']:.6f}, rollout {sample['rollout_log_prob']:.6f}"


def plot(samples: list[dict], threshold: float, rollout_id: int, path: Path) -> Path:
    """The PNG at `path`, written atomically: a panel per sample of `worst_samples`."""
    plt = pyplot()
    longest = max(len(s["log_probs"]) for s in samples)
    width = min(max(7.0, 0.3 * longest), 40.0)
    fig, axes = plt.subplots(len(samples), 1, figsize=(width, 3.2 * len(samples)), squeeze=False)
    for ax, s in zip(axes[:, 0], samples):
        x = range(len(s["log_probs"]))
        ax.plot(x, s["log_probs"], marker=".", label="train log_probs")
        ax.plot(x, s["rollout_log_probs"], marker=".", linestyle="--", label="rollout_log_probs")
        marked = over_threshold(s, threshold)
        ax.scatter(marked, [s["log_probs"][t] for t in marked], s=80, facecolors="none", edgecolors="red",
                   zorder=3, label=f"|Δ| > {threshold:g}")
        step = max(1, math.ceil(len(x) / MAX_LABELS))
        labels = [t.replace(" ", "␣") for t in s["token_texts"]] if s["token_texts"] else [
            str(t) for t in s["token_ids"] or x]  # (a space-led BPE token would look like another)
        ax.set_xticks(list(x)[::step], labels[::step], rotation=90, fontsize=7)
        ax.set_xlabel("trained token")
        ax.set_ylabel("log-prob")
        ax.set_title(f"rollout {rollout_id}, {where(s)}", fontsize=9)
        bars = ax.twinx()  # |Δ| on its own scale: rounding-sized differences are invisible on the lines
        bars.bar(x, s["abs_diffs"], color="gray", alpha=0.3, label="|Δ| (right axis)")
        bars.set_ylabel("|Δ|", color="gray")
        ax.set_zorder(bars.get_zorder() + 1)  # the lines over the bars
        ax.patch.set_visible(False)
        handles = [h for a in (ax, bars) for h in a.get_legend_handles_labels()[0]]
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.14, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
    plt.close(fig)
    return path
