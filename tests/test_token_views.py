"""Tokens and batches: train/token_mult_prob_error, the worst samples' per-token picture in
`relax inspect`, and the batch-invariance check (debug.check_batch_invariance)."""

import json
import math
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from relax.tools import token_views
from relax.debug.checks import Thresholds, diagnose
from relax.tools.inspect import inspect
from relax.debug.run_data import load_run
from relax.files import safe_load
from relax.sample import Sample
from relax.train import common
from relax.train.batch_invariance import KEY

from .conftest import local_trainer, make_cfg, run_loop

SHORT = ["rollout.rollout_batch_size=8", "checkpoint.save_interval=null"]
MULT = common.STEP_KEYS.index("train/token_mult_prob_error")


# -- train/token_mult_prob_error ---------------------------------------------------------------

def micro_batch(log_probs, rollout_log_probs, mask) -> tuple[torch.Tensor, common.MicroBatch]:
    lp, rollout_lp, mask = (torch.tensor(x) for x in (log_probs, rollout_log_probs, mask))
    b, t = mask.shape
    tokens = torch.zeros(b, t, dtype=torch.long)
    return lp, common.MicroBatch(list(range(b)), tokens, tokens, mask, torch.ones(b), rollout_lp, mask)


def mult_prob_error(log_probs, rollout_log_probs, mask) -> float:
    lp, mb = micro_batch(log_probs, rollout_log_probs, mask)
    _, sums = common.objective(lp, torch.zeros_like(lp), mb, make_cfg().algo)
    return (sums[MULT] / mb.mask.sum()).item()


def test_token_mult_prob_error_by_hand():
    """exp(|train - rollout|) averaged over the trained tokens, as NeMo-RL logs it. Untrained
    positions count for nothing, even with a difference whose exp() overflows to inf."""
    log_probs = [[-1.0, -0.5, -2.0, -1e4], [0.0, -0.3, -0.7, 0.0]]
    rollout = [[-1.2, -0.5, -1.5, 0.0], [0.0, -0.1, -0.7, 0.0]]
    mask = [[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]]
    expected = (math.exp(0.2) + 1 + math.exp(0.5) + math.exp(0.2) + 1) / 5  # = 1.27236...
    assert mult_prob_error(log_probs, rollout, mask) == pytest.approx(expected, rel=1e-6)
    assert mult_prob_error(log_probs, log_probs, mask) == 1.0  # identical: exactly 1


def test_the_trainer_logs_exactly_1_when_the_rollout_log_probs_are_its_own(tiny_path, tokenizer):
    cfg = make_cfg()
    trainer = local_trainer(cfg, str(tiny_path), ref_model_path=str(tiny_path),
                           pad_token_id=tokenizer.pad_token_id)
    prompt = tokenizer.encode("<|user|>12+34=<|assistant|>")
    samples = [Sample(index=i, group_index=0, prompt="", tokens=prompt + response,
                      response_length=len(response), reward=float(i == 0), loss_mask=[1] * len(response),
                      rollout_log_probs=[-1.0] * len(response))
               for i, response in enumerate([[10, 11, 1], [12, 1], [13, 14, 15, 1]])]
    mb = common.make_micro_batch(samples, torch.zeros(3), tokenizer.pad_token_id)
    with torch.no_grad():  # the trainer's own log-probs of these samples, in the same batch
        own = common.per_sample(trainer._log_probs(trainer.actor, mb)[0], mb)
    for s in samples:
        s.rollout_log_probs = own[s.index]
    step = trainer.train(0, samples)["steps"][0]
    assert step["train/train_rollout_logprob_abs_diff"] == 0.0
    assert step["train/token_mult_prob_error"] == 1.0


# -- the worst samples, token by token ---------------------------------------------------------

class Chars:
    """A tokenizer that decodes id n to chr(ord('a') + n)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def row(index: int, diffs: list[float], prompt: int = 2) -> dict:
    response = list(range(len(diffs) + 1))  # the last token is a tool's: loss_mask 0
    lp = [-1.0 - t for t in range(len(diffs))]
    return {"index": index, "tokens": [20] * prompt + response, "loss_mask": [1] * len(diffs) + [0],
            "log_probs": lp, "rollout_log_probs": [a + d for a, d in zip(lp, diffs)]}


def test_worst_samples_are_the_largest_max_differences():
    # (differences a float holds exactly, so that the tie is one)
    train = {0: row(0, [0.0, 0.0625, 0.0]), 1: row(1, [0.0, 0.0, -0.5]), 2: row(2, [0.25, 0.0]),
             3: row(3, [0.0, 0.25]), 4: row(4, [0.125, 0.125, 0.125, 0.0]), 5: row(5, [])}
    worst = token_views.worst_samples(train, 3, Chars())
    assert [w["index"] for w in worst] == [1, 2, 3]  # 0.5, then a tie of 0.25: the lower index first
    assert [w["position"] for w in worst] == [2, 0, 1]
    assert [w["token"] for w in worst] == [2, 0, 1] and [w["token_text"] for w in worst] == ["c", "a", "b"]
    assert worst[0]["max_abs_diff"] == pytest.approx(0.5) and worst[0]["token_texts"] == ["a", "b", "c"]
    assert token_views.over_threshold(token_views.worst_samples(train, 6)[3], 0.1) == [0, 1, 2]
    assert token_views.describe(worst[0]) == \
        "sample 1: max |Δ| 0.5 at token 2 'c' (id 2): log_prob -3.000000, rollout -3.500000"
    train[0]["log_probs"][1] = math.nan  # a NaN is the worst there is
    assert token_views.worst_samples(train, 1)[0]["index"] == 0


def test_trained_tokens_and_the_marked_ones_by_hand():
    """A row's trained token ids are its response's loss_mask-1 tokens, or None when their count is
    not its log-probs'; a NaN difference is always marked, as over any threshold."""
    r = row(0, [0.0, 0.25, 0.0])  # tokens 20 20 | 0 1 2 3, the last a tool's
    assert token_views.trained_token_ids(r) == [0, 1, 2]
    assert token_views.trained_token_ids({**r, "loss_mask": [1, 0, 1, 0]}) is None  # 2 ids, 3 log-probs
    r["rollout_log_probs"][2] = math.nan
    sample = token_views.worst_samples({0: r}, 1)[0]
    assert sample["position"] == 2 and token_views.over_threshold(sample, 0.1) == [1, 2]


@pytest.fixture(scope="module")
def checked_run(tmp_path_factory, tiny_path):
    """A dumped run with the batch-invariance check on."""
    run = tmp_path_factory.mktemp("checked")
    rollouts, steps = run_loop(run, *SHORT, "rollout.num_rollout=2", "debug=dump",
                               "debug.check_batch_invariance=true")
    return run, steps


PERTURBED = {5: (-1, 0.5), 2: (0, -0.3), 9: (-1, 0.2), 11: (0, 0.05)}  # sample: (trained token, Δ)


def test_inspect_plots_the_worst_samples_tokens(checked_run, tmp_path):
    """On a dump whose train log-probs are moved at known tokens, the worst three samples and
    their tokens are the moved ones; the picture is a PNG in <dir>/plots/."""
    run = tmp_path / "run"
    shutil.copytree(checked_run[0], run)
    path = run / "train_data" / "0_0.pt"
    data = safe_load(path)
    rows = {r["index"]: r for r in data["samples"]}
    at = {i: t % len(rows[i]["log_probs"]) for i, (t, _) in PERTURBED.items()}
    for index, (_, delta) in PERTURBED.items():
        rows[index]["log_probs"][at[index]] = rows[index]["rollout_log_probs"][at[index]] + delta
    torch.save(data, path)

    report = inspect(run, 0, 0)
    join = report["train_join"]
    assert [w["index"] for w in join["worst_samples"]] == [5, 2, 9]
    assert [w["position"] for w in join["worst_samples"]] == [at[5], 0, at[9]]
    assert [w["over_threshold"] for w in join["worst_samples"]] == [[at[5]], [0], [at[9]]]
    for w in join["worst_samples"]:
        trained = [t for t, m in zip(rows[w["index"]]["tokens"][-len(rows[w["index"]]["loss_mask"]):],
                                     rows[w["index"]]["loss_mask"]) if m]
        assert w["token"] == trained[w["position"]] and w["token_text"]  # decoded with the dump's tokenizer
    plot = run / "plots" / "token_logprobs_0.png"
    assert join["token_plot"] == str(plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    # --threshold moves the marks; --worst picks how many
    fourth = inspect(run, 0, 0, worst=4, threshold=0.01)["train_join"]["worst_samples"]
    assert [w["index"] for w in fourth] == [5, 2, 9, 11] and fourth[3]["over_threshold"] == [0]

    text = subprocess.run([sys.executable, "-m", "relax", "inspect", str(run), "--worst", "2"],
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert f"(tokens over 0.1 marked): {plot}" in text.stdout
    assert f"  sample 5: max |Δ| 0.5 at token {at[5]} '" in text.stdout
    assert "  sample 2: max |Δ| 0.3 at token 0 '" in text.stdout and "sample 9: max" not in text.stdout
    # the doctor's mismatch check points to it
    check5 = next(c for c in diagnose(load_run(run)) if c.id == 5)
    assert f"worst tokens: relax inspect {run} --rollout" in check5.summary


# -- batch invariance --------------------------------------------------------------------------

def test_batch_invariance_is_reported_at_the_first_step(checked_run):
    run, steps = checked_run
    first, later = steps[0], steps[1:]
    assert 0 <= first[KEY] < Thresholds().batch_invariance_tol  # fp32, CPU: the padding's rounding, 2.9e-6
    assert all(KEY not in s for s in later)  # the run's first step only
    check8 = next(c for c in diagnose(load_run(run)) if c.id == 8)
    assert check8.verdict == "PASS" and f"max |Δ| {first[KEY]:.2e}" in check8.summary
    doctor = subprocess.run([sys.executable, "-m", "relax", "doctor", str(run)], capture_output=True,
                            text=True, timeout=120)
    assert "[PASS] 8. batch invariance of the first step's log-probs: max |Δ|" in doctor.stdout
    report = json.loads(subprocess.run([sys.executable, "-m", "relax", "doctor", str(run), "--json"],
                                       capture_output=True, text=True, timeout=120).stdout)
    assert report["checks"][7]["evidence"][KEY] == first[KEY]


def test_a_batch_dependent_forward_is_flagged(tmp_path, monkeypatch):
    """The `batch_variant` fault scales the logits by 1 + 1e-4 x the micro-batch's rows."""
    monkeypatch.setenv("RELAX_FAULT", "batch_variant")
    _, steps = run_loop(tmp_path, *SHORT, "rollout.num_rollout=1", "debug.check_batch_invariance=true")
    assert steps[0][KEY] > 1e-2  # measured 4.5e-2 (64 samples in one micro-batch against 1)
    check8 = next(c for c in diagnose(load_run(tmp_path)) if c.id == 8)
    assert check8.verdict == "WARN" and "change with the samples batched with it" in check8.summary
    assert "train.micro_batch_size=1" in check8.next_steps[0]


def test_the_check_is_off_by_default(tmp_path):
    _, steps = run_loop(tmp_path, *SHORT, "rollout.num_rollout=1")
    assert KEY not in steps[0] and steps[0]["train/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["", "batch_variant"])
def test_megatron_reports_batch_invariance_and_token_mult_prob_error(tmp_path, monkeypatch, fault):
    """train=megatron recomputes through its own schedules (measured: single 3.1e-6, pp2 3.1e-6,
    cp2 2.9e-6; with the fault at micro_batch_size=8, 5.0e-3)."""
    monkeypatch.setenv("RELAX_FAULT", fault)
    _, steps = run_loop(tmp_path, *SHORT, "train=megatron", "train.micro_batch_size=8",
                        "rollout.num_rollout=1", "debug.check_batch_invariance=true")
    assert (steps[0][KEY] > 1e-3) if fault else (steps[0][KEY] < Thresholds().batch_invariance_tol)
    assert steps[0]["train/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-2 if fault else 1e-5)


def two_micro_batches() -> list[common.MicroBatch]:
    """Samples 0 and 5, then a padding row and sample 2: 4 positions, distinct tokens per row,
    the first pass's old_log_probs -(row + position / 10)."""
    mbs = []
    for m, (indices, mask) in enumerate([([0, 5], [[0, 1, 1, 0], [0, 0, 1, 1]]),
                                         ([-1, 2], [[0, 0, 0, 0], [0, 1, 1, 1]])]):
        tokens = torch.arange(8).reshape(2, 4) + 10 * m + 1
        mask = torch.tensor(mask, dtype=torch.float32)
        old = -(torch.arange(2).unsqueeze(1) + 2 * m + torch.arange(4) / 10)
        mbs.append(common.MicroBatch(indices, tokens, tokens + 100, mask, torch.tensor([0.5, -0.5]) + m,
                                     old - 0.01, mask * 0.25, old_log_probs=old,
                                     prompt_lengths=[1 + m, 2], lengths=[4, 3 + m]))
    return mbs


def test_batch_invariance_scores_each_sample_alone_and_reports_the_largest_trained_difference(monkeypatch):
    """check() by hand: every sample (no padding row) goes to `forward` in a micro-batch of its
    own, without grad, padded on the right by 8 positions rounded up to the layout's length
    multiple (pad id, mask 0); the result is the largest |Δ| from the first pass over trained
    tokens only (a NaN kept) and over every DP rank, only where due (the first step, the key on)."""
    from relax.train import batch_invariance

    mbs, seen = two_micro_batches(), []
    # recomputed: the first pass, moved at trained tokens by these, +5 at an untrained one
    moved = {0: (1, 0.25), 5: (3, -0.5), 2: (2, 0.125)}

    def forward(alone):
        seen.append((alone, torch.is_grad_enabled()))
        out = []
        for a in alone:
            i = a.indices[0]
            mb, b = next((mb, mb.indices.index(i)) for mb in mbs if i in mb.indices)
            lp = torch.cat([mb.old_log_probs[b], torch.full((a.tokens.shape[1] - 4,), 7.0)])
            lp[moved[i][0]] += moved[i][1]
            lp[0] += 5.0  # (never trained)
            out.append(lp.unsqueeze(0))
        return out

    with torch.enable_grad():
        got = batch_invariance.check(True, mbs, forward, pad_id=99, layout=SimpleNamespace(dp_size=1),
                                     length_multiple=3)
    assert got == {KEY: 0.5}
    (alone, grad), = seen
    assert not grad and [a.indices for a in alone] == [[0], [5], [2]]
    for a, (m, b) in zip(alone, [(0, 0), (0, 1), (1, 1)]):
        mb, pad = mbs[m], torch.zeros(9)
        assert torch.equal(a.tokens[0], torch.cat([mb.tokens[b], pad + 99]))
        assert torch.equal(a.targets[0], torch.cat([mb.targets[b], pad + 99]))
        assert torch.equal(a.mask[0], torch.cat([mb.mask[b], pad]))
        assert torch.equal(a.loss_weights[0], torch.cat([mb.loss_weights[b], pad]))
        assert torch.equal(a.rollout_log_probs[0], torch.cat([mb.rollout_log_probs[b], pad]))
        assert torch.equal(a.advantages, mb.advantages[b:b + 1])
        assert a.prompt_lengths == mb.prompt_lengths[b:b + 1] and a.lengths == mb.lengths[b:b + 1]
    # the extra padding: 8 rounded up to the multiple
    for multiple, width in [(1, 12), (8, 12), (16, 20)]:
        seen.clear()
        batch_invariance.check(True, mbs, forward, 99, SimpleNamespace(dp_size=1),
                               length_multiple=multiple)
        assert {a.tokens.shape[1] for a in seen[0][0]} == {width}, multiple
    # the largest over the DP ranks; a NaN on any trained token kept
    monkeypatch.setattr(batch_invariance, "dp_all_gather", lambda x, layout: [0.25, x, 0.75])
    assert batch_invariance.check(True, mbs, forward, 99, None) == {KEY: 0.75}
    moved[5] = (2, math.nan)
    assert math.isnan(batch_invariance.check(True, mbs, forward, 99, None)[KEY])
    # not due: nothing recomputed; a rank without results still recomputes
    seen.clear()
    assert batch_invariance.check(False, mbs, forward, 99, None) == {} and not seen
    assert batch_invariance.check(True, mbs, forward, 99, None, holds_results=False) == {}
    assert len(seen) == 1
