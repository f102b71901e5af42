"""train.shared_prompt (relax/train/packing.py): a group's prompt runs once, and every number is
the one-row-per-sample forward's within fp32 rounding."""

import random

import pytest
import torch

from relax.errors import ConfigError
from relax.model import read_hf_config
from relax.sample import Sample
from relax.train import common, packing

from .conftest import local_trainer, make_cfg, trainer_checks

PAD = 0


def samples(vocab: int, groups: list[tuple[int, list[int]]], seed: int = 0) -> list[Sample]:
    """Groups of (prompt length, response lengths) with random tokens; one response of each group
    of more than one has a gap in its loss mask (a multi-turn tool reply)."""
    rng, out = random.Random(seed), []
    for g, (prompt_length, responses) in enumerate(groups):
        prompt = [rng.randrange(1, vocab) for _ in range(prompt_length)]
        for k, n in enumerate(responses):
            mask = [1] * n
            if k == 1:
                mask[1:3] = [0, 0]
            out.append(Sample(len(out), g, "", prompt + [rng.randrange(1, vocab) for _ in range(n)], n,
                              loss_mask=mask, rollout_log_probs=[-1.0] * n))
    return out


def micro_batch(ss: list[Sample]) -> common.MicroBatch:
    return common.make_micro_batch(ss, torch.linspace(-1, 1, len(ss)), PAD)


def test_each_group_is_one_row_and_a_response_sees_only_its_prompt_and_itself():
    mb = micro_batch(samples(20, [(3, [2, 4]), (5, [3])]))
    p = packing.pack(mb, PAD, torch.float32)
    t = mb.tokens.tolist()
    # group 0: prompt (3), response 0 without its last token (1), response 1 (3); group 1: 5 + 2
    assert p.tokens.tolist() == [t[0][:3] + t[0][3:4] + t[1][3:6], t[2][:5] + t[2][5:7]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]]
    sees = p.attention_mask[:, 0] == 0
    assert sees[0].int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],  # response 0: the prompt and itself
        [1, 1, 1, 0, 1, 0, 0],  # response 1: the prompt, not response 0
        [1, 1, 1, 0, 1, 1, 0],
        [1, 1, 1, 0, 1, 1, 1]]
    assert torch.equal(sees[1], torch.ones(7, 7, dtype=torch.bool).tril())
    # every response token is predicted from one kept position: the prompt's last, then its own
    assert p.keep.tolist() == [2, 3, 4, 5, 6]
    kept = p.keep[p.packed_col].tolist()
    assert list(zip(p.rows.tolist(), p.cols.tolist(), p.packed_row.tolist(), kept)) == [
        (0, 2, 0, 2), (0, 3, 0, 3),
        (1, 2, 0, 2), (1, 3, 0, 4), (1, 4, 0, 5), (1, 5, 0, 6),
        (2, 4, 1, 4), (2, 5, 1, 5), (2, 6, 1, 6)]


def test_padding_attends_causally_to_itself_so_no_softmax_row_is_empty():
    """Rows of unequal length: a padding position sees the padding up to itself, nothing else
    (an all-masked row is a softmax of nothing, NaN in some kernels, and 0 x NaN reaches real tokens)."""
    mb = micro_batch(samples(20, [(3, [2]), (5, [3, 2])]))
    p = packing.pack(mb, PAD, torch.float32)
    assert p.tokens.shape == (2, 8) and p.tokens[0, 4:].tolist() == [PAD] * 4
    sees = p.attention_mask[:, 0] == 0
    assert sees.diagonal(dim1=-2, dim2=-1).all()
    assert torch.equal(sees[0, 4:, 4:], torch.ones(4, 4, dtype=torch.bool).tril())
    assert not sees[0, 4:, :4].any()
    assert not sees[0, :4, 4:].any()  # and nothing real sees padding


def test_packed_once_per_dtype():
    """The reference, old-log-prob and training forwards share one packing; a model of another
    dtype gets its mask in that dtype (min of bf16, not fp32's -3.4e38, which bf16 rounds to -inf)."""
    mb = micro_batch(samples(20, [(3, [2, 4])]))
    first = packing.packed(mb, PAD, torch.float32)
    assert packing.packed(mb, PAD, torch.float32) is first
    half = packing.packed(mb, PAD, torch.bfloat16)
    assert half.attention_mask.dtype == torch.bfloat16 and mb.packed is half
    assert half.attention_mask.min().item() == torch.finfo(torch.bfloat16).min
    assert torch.equal(half.tokens, first.tokens)
    assert torch.equal(half.attention_mask == 0, first.attention_mask == 0)


def forward_and_grads(trainer, mb, shared: bool):
    trainer.model.zero_grad(set_to_none=True)
    log_probs, entropy = trainer._log_probs(trainer.actor, mb, shared_prompt=shared)
    (log_probs * mb.loss_weights).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    with torch.no_grad():
        ref, _ = trainer._log_probs(trainer.ref, mb, shared_prompt=shared)
    return log_probs.detach(), entropy, grads, ref


def assert_packing_matches(trainer, mb, atol: float, grad_rtol: float):
    one_row, one_row_entropy, one_row_grads, _ = forward_and_grads(trainer, mb, shared=False)
    log_probs, entropy, grads, ref = forward_and_grads(trainer, mb, shared=True)
    trained = mb.mask > 0
    assert (log_probs - one_row)[trained].abs().max() <= atol
    assert (entropy - one_row_entropy)[trained].abs().max() <= atol
    assert ((grads - one_row_grads).norm() / one_row_grads.norm()).item() <= grad_rtol
    # first-step exactness holds on the packed path itself: reference and actor are bit-equal
    assert torch.equal(ref[trained], log_probs[trained])
    return (log_probs - one_row)[trained].abs().max().item()


def test_log_probs_entropy_and_gradients_equal_one_row_per_sample(tiny_path):
    cfg = make_cfg("algo.entropy_coef=0.01")
    trainer = local_trainer(cfg, str(tiny_path), ref_model_path=str(tiny_path), pad_token_id=PAD)
    vocab = read_hf_config(tiny_path)["vocab_size"]
    mb = micro_batch(samples(vocab, [(8, [3, 6, 1, 4]), (11, [5, 2]), (6, [7])]))
    # measured: 1e-6 (log-probs), 1e-6 (gradients, relative): tolerances of a few fp32 roundings
    assert_packing_matches(trainer, mb, atol=1e-5, grad_rtol=1e-5)


def test_megatron_refuses_shared_prompt():
    hf = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32, "intermediate_size": 64}
    trainer_checks(make_cfg("train=megatron"), hf)  # its default is off
    with pytest.raises(ConfigError, match=r"train.shared_prompt=true is train=torch's.*RoPE"):
        trainer_checks(make_cfg("train=megatron", "train.shared_prompt=true"), hf)


@pytest.mark.slow
def test_the_real_model_packs_within_fp32_rounding(smollm2_path):
    """SmolLM2 (30 layers, GQA, tied embeddings, rope theta 1e5) on a GRPO-shaped micro-batch:
    4 prompts of the chat template's length x 4 responses."""
    cfg = make_cfg("model=smollm2", "algo.entropy_coef=0.01")
    trainer = local_trainer(cfg, str(smollm2_path), ref_model_path=str(smollm2_path), pad_token_id=2)
    mb = micro_batch(samples(49152, [(46, [24, 9, 17, 24]), (44, [3, 24, 24, 12]), (47, [24] * 4),
                                     (45, [1, 2, 24, 24])]))
    # measured 1.9e-5 on 30 layers (the tiny model's 2 give 1e-6): rounding grows with depth
    assert_packing_matches(trainer, mb, atol=1e-4, grad_rtol=1e-4)
