"""rollout.true_on_policy (relax/model/invariant.py): the engine's log-prob of every sampled token
equals the trainer's to the bit, at every step, on the layouts it covers; what it cannot make
exact is refused at start-up. The gate: without it, the same runs are only close."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from relax.errors import ConfigError
from relax.model import invariant
from relax.model.invariant import invariant_attention, invariant_ops

from .conftest import make_cfg, relax_cli

RUN = ["rollout.num_rollout=3", "rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4",
       "rollout.max_new_tokens=12"]
KEYS = ("train/train_rollout_logprob_abs_diff", "train/mismatch_kl")
# a lone 64-row tile of a 1024-wide MLP's down projection is one that BLAS splits across 2 threads
TWO_THREADS = ["train.num_threads=2", "model.tiny.intermediate_size=1024", "model.tiny.warmup_max_steps=25"]


def mismatch(tmp_path, *overrides) -> list[tuple[float, float]]:
    proc = relax_cli(*RUN, *overrides, "hydra.run.dir=outputs/run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "outputs/run/metrics.jsonl").read_text().splitlines()]
    steps = [tuple(r[k] for k in KEYS) for r in records if "step" in r]
    assert len(steps) == 3
    return steps


@pytest.mark.parametrize("overrides", [
    ["parallel=single"], ["parallel=dp2"], ["parallel=fsdp2"], ["model.dtype=bfloat16"],
    ["model.tiny.num_experts=4"], TWO_THREADS], ids=["single", "dp2", "fsdp2", "bf16", "moe", "2-threads"])
def test_engine_and_trainer_log_probs_are_equal_at_every_step(tmp_path, overrides):
    assert mismatch(tmp_path, "rollout.true_on_policy=true", *overrides) == [(0.0, 0.0)] * 3


def test_without_it_the_same_run_is_only_close(tmp_path):
    steps = mismatch(tmp_path)
    assert all(0 < diff < 1e-5 and 0 < kl < 1e-9 for diff, kl in steps)


@pytest.mark.parametrize("overrides,message", [
    (["rollout.top_p=0.9"], "rollout.top_p=0.9 is refused: the trainer scores the whole softmax"),
    (["rollout.dtype=bfloat16"], "rollout.dtype=bfloat16 is refused: engine and trainer compute in one dtype"),
    (["parallel=tp2"], "parallel.tp=2 is refused: tensor parallelism sums"),
    (["train.lora.rank=4"], "train.lora.rank=4 is refused: the trainer computes W x + B(A x)"),
    (["model.tiny.num_experts=4", "algo.routing_replay=rollout"], "algo.routing_replay=rollout is refused"),
    (["model.dtype=bfloat16", "train.num_threads=2"],
     "train.num_threads=2 with model.dtype=bfloat16 is refused: BLAS's bfloat16 kernel splits a product"),
    (["train=megatron"], "rollout.true_on_policy=true is refused with train=megatron"),
    (["rollout=sglang"], "rollout.true_on_policy=true is refused with rollout=sglang"),
])
def test_what_it_cannot_make_exact_is_refused_at_start_up(overrides, message):
    from relax.debug.plan import resolve

    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(make_cfg("rollout.true_on_policy=true", *overrides))


def test_a_rows_matmul_result_does_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    x, w = torch.randn(203, 96), torch.randn(160, 96)
    with invariant_ops():
        whole = F.linear(x, w)
        alone = [F.linear(x[i:i + 1], w) for i in range(0, 203, 11)]
        strided = F.linear(x.view(1, 203, 96)[:, ::11], w)  # (a strided 3-D input goes through bmm)
    assert all(torch.equal(whole[i * 11], row[0]) for i, row in enumerate(alone))
    assert torch.equal(strided[0], whole[::11])
    plain = [F.linear(x[i:i + 1], w)[0] for i in range(0, 203, 11)]  # the gate: aten's own kernels differ
    assert not all(torch.equal(whole[i * 11], row) for i, row in enumerate(plain))


@pytest.fixture
def threads():
    """torch.set_num_threads for the test, restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_with_more_threads_every_tile_is_still_one_threads_product(threads):
    """BLAS splits a lone product's reduction across threads; every call holds at least one
    product per thread, so each is computed whole by one thread, as with one thread."""
    torch.manual_seed(0)
    x, w = torch.randn(130, 1024), torch.randn(64, 1024)
    q, k = torch.randn(2, 19, 16), torch.randn(2, 16, 40)  # attention's products: a batch of 2
    results = {}
    for n in (1, 2, 4):
        threads(n)
        with invariant_ops():
            results[n] = F.linear(x, w), F.linear(x[:1], w), torch.bmm(q, k), torch.bmm(q[1:, :3], k[1:])
        if n == 2:  # the gate: BLAS splits this lone tile at 2 threads
            lone = torch.baddbmm(x.new_zeros(()).expand(1, 64, 64), x[None, :64], w.t()[None], beta=0)
    whole, row, scores, part = results[1]
    for n in (2, 4):
        assert torch.equal(results[n][0], whole) and torch.equal(results[n][1][0], whole[0])
        assert torch.equal(results[n][2], scores) and torch.equal(results[n][3], scores[1:, :3])
    assert torch.equal(row[0], whole[0]) and torch.equal(part, scores[1:, :3])
    if torch.equal(lone[0], whole[:64]):
        pytest.skip("this CPU's BLAS keeps a lone tile whole at 2 threads: nothing above was at risk here")


def test_a_decode_steps_rows_equal_the_trainers_at_2_threads(threads):
    """SmolLM2's layer shapes: a decode step's 32 rows (fewer tiles than threads: a call per tile
    over the column blocks) and a row alone equal the same rows among a trainer's 600."""
    torch.manual_seed(0)
    threads(2)
    for k, m in [(576, 576), (1536, 576), (576, 49152)]:
        x, w = torch.randn(600, k), torch.randn(m, k) / 20
        with torch.no_grad(), invariant_ops():
            whole, step, alone = F.linear(x, w), F.linear(x[:32], w), F.linear(x[:1], w)
        assert torch.equal(step, whole[:32]) and torch.equal(alone[0], whole[0]), (k, m)


def test_bf16_products_are_split_across_threads_in_some_batches(threads):
    """Why bf16 with train.num_threads > 1 is refused: its batched kernel (oneDNN's, whose choice
    depends on the CPU) splits a product of a 3-tile call across 2 threads; fp32's does not."""
    torch.manual_seed(0)
    x, w = torch.randn(192, 1536), torch.randn(576, 1536) / 20
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = x.to(dtype).view(3, 64, 1536), w.to(dtype).t().expand(3, -1, -1)
        for n in (1, 2):
            threads(n)
            out[dtype, n] = torch.baddbmm(a.new_zeros(()).expand(3, 64, 576), a, b, beta=0)
    assert torch.equal(out[torch.float32, 1], out[torch.float32, 2])
    if torch.equal(out[torch.bfloat16, 1], out[torch.bfloat16, 2]):
        pytest.skip("this CPU's bf16 kernel keeps a 3-tile call's products whole: the refusal is only cautious here")


def test_attention_decoded_one_token_at_a_time_equals_the_full_causal_forward():
    torch.manual_seed(0)
    B, H, Hkv, T, D = 3, 4, 2, 19, 16
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, 1, T, T)
    module = None
    with invariant_ops():
        full, _ = invariant_attention(module, q, k, v, causal)
        steps = [invariant_attention(module, q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1],
                                     causal[:, :, t:t + 1, :t + 1])[0] for t in range(T)]
    assert torch.equal(full, torch.cat(steps, dim=1))
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert (full - sdpa.transpose(1, 2)).abs().max() < 1e-5  # the same attention, summed otherwise


def test_a_left_padded_row_decodes_as_the_same_row_unpadded():
    """The engine decodes prompts of several lengths in one left-padded batch: a row's keys are
    shifted by its padding (found from position_ids), so every step equals the unpadded row's."""
    torch.manual_seed(1)
    H, T, D, pad = 2, 37, 8, 5
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    padded = [torch.cat([torch.randn(1, H, pad, D), x], dim=2) for x in (q, k, v)]
    mask = torch.ones(T + pad, T + pad, dtype=torch.bool).tril()[None, None].clone()
    mask[..., :pad] = False  # the padding is never attended to
    with invariant_ops():
        alone, _ = invariant_attention(None, q, k, v, causal, position_ids=torch.arange(T)[None])
        for t in (0, 9, T - 1):  # a decode step of the padded row: one query over its cache
            at = pad + t
            step, _ = invariant_attention(None, padded[0][:, :, at:at + 1], padded[1][:, :, :at + 1],
                                          padded[2][:, :, :at + 1], mask[:, :, at:at + 1, :at + 1],
                                          position_ids=torch.tensor([[t]]))
            assert torch.equal(step[:, 0], alone[:, t])
        unshifted, _ = invariant_attention(None, padded[0][:, :, -1:], padded[1], padded[2], mask[:, :, -1:])
    assert not torch.equal(unshifted[:, 0], alone[:, -1])  # without position_ids: summed in other chunks


def test_a_packed_response_attends_as_its_own_row():
    """train.shared_prompt packs a group's responses behind one prompt: each response's queries
    still sum over their keys in position order (the prompt's, then their own), so they equal
    the unpacked rows to the bit, and padding (which sees no key 0) gets zeros."""
    torch.manual_seed(2)
    H, D, P, lengths = 2, 8, 20, (7, 1, 15)
    prompt = torch.randn(3, H, P, D)  # q, k, v of the prompt
    responses = [torch.randn(3, H, n, D) for n in lengths]
    L = P + sum(lengths) + 3  # 3 pads at the end
    packed = torch.cat([prompt, *responses, torch.zeros(3, H, 3, D)], dim=2)[:, None]  # [3, 1, H, L, D]
    attend = torch.zeros(L, L, dtype=torch.bool)
    attend[:P, :P] = torch.ones(P, P).tril().bool()
    start = P
    for n in lengths:
        attend[start:start + n, :P] = True
        attend[start:start + n, start:start + n] = torch.ones(n, n).tril().bool()
        start += n
    attend[start:, start:] = torch.ones(3, 3).tril().bool()
    additive = torch.zeros(L, L).masked_fill(~attend, torch.finfo(torch.float32).min)[None, None]
    with invariant_ops():
        out, _ = invariant_attention(None, packed[0], packed[1], packed[2], additive)
        start = P
        for r, n in zip(responses, lengths):
            row = [torch.cat([prompt[j:j + 1], r[j:j + 1]], dim=2) for j in range(3)]
            causal = torch.ones(P + n, P + n, dtype=torch.bool).tril()[None, None]
            alone, _ = invariant_attention(None, *row, causal)
            assert torch.equal(out[:, start:start + n], alone[:, P:])
            if start == P:
                assert torch.equal(out[:, :P], alone[:, :P])  # the prompt's queries, once
            start += n
    assert torch.equal(out[:, start:], torch.zeros_like(out[:, start:]))


def test_the_ops_are_aten_s_own_outside_the_block():
    x, w = torch.randn(5, 8), torch.randn(3, 8)
    with invariant_ops():
        pass
    assert torch.equal(F.linear(x, w), x @ w.t())
    assert invariant.INVARIANT == "relax_invariant"


@pytest.mark.slow
def test_the_real_model_is_exact_at_every_step(smollm2_path, tmp_path):
    steps = mismatch(tmp_path, "model=smollm2", "rollout.true_on_policy=true", "rollout.rollout_batch_size=2",
                     "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8",
                     "train.num_threads=2")  # (the recipe's; its down projection's lone tile is split at 2)
    assert steps == [(0.0, 0.0)] * 3
