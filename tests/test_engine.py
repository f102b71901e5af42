"""The torch rollout engine against transformers and against the trainer's forward."""

import random

import pytest
import torch

from relax.algo import token_log_probs
from relax.model import load_causal_lm
from relax.rollout import SamplingParams, prompt_seeds
from relax.rollout.torch_engine import TorchEngine
from relax.sample import log_prob_temperature
from relax.task.arithmetic import make_problem

from .conftest import engine_spec, make_cfg


def engine_for(path, tokenizer):
    return TorchEngine(make_cfg().rollout, engine_spec(make_cfg(), path, [tokenizer.eos_token_id], tokenizer.pad_token_id))


def chat_prompts(tokenizer, n, lo=10, hi=99, seed=0, repeat=1):
    """n prompts: n / repeat distinct problems, each `repeat` times in a row (a GRPO group)."""
    rng = random.Random(seed)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": make_problem(rng, lo, hi)[0]}],
                                           add_generation_prompt=True, tokenize=False)
             for _ in range(n // repeat)]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts for _ in range(repeat)]


def hf_greedy(model, prompt, tokenizer, max_new_tokens):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    tokens = out[0, len(prompt):].tolist()
    if tokenizer.eos_token_id in tokens:
        tokens = tokens[:tokens.index(tokenizer.eos_token_id) + 1]
    return tokens


@pytest.mark.parametrize("lo,hi,repeat", [(10, 99, 1), (1, 999, 1), (1, 999, 4)],
                         ids=["equal-length", "left-padded", "shared-prefill"])
def test_greedy_equals_hf_greedy(tiny_path, tokenizer, lo, hi, repeat):
    prompts = chat_prompts(tokenizer, 24, lo, hi, repeat=repeat)
    if lo == 1:
        assert len({len(p) for p in prompts}) > 1  # the batch really needs padding
    gens = engine_for(tiny_path, tokenizer).generate(prompts, SamplingParams(0.0, 1.0, 8), seed=0)
    model = load_causal_lm(tiny_path, "float32")
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.tokens == hf_greedy(model, prompt, tokenizer, 8)
    assert any(g.status == "completed" for g in gens)


@pytest.mark.parametrize("temperature,repeat", [(1.0, 1), (0.7, 1), (1.0, 8), (0.0, 4)])
def test_rollout_log_probs_match_teacher_forced_forward(tiny_path, tokenizer, temperature, repeat):
    """At every temperature, greedy (0: the unscaled softmax) included."""
    prompts = chat_prompts(tokenizer, 32, 1, 999, seed=1, repeat=repeat)
    gens = engine_for(tiny_path, tokenizer).generate(
        prompts, SamplingParams(temperature, 1.0, 8), seed=3)
    model = load_causal_lm(tiny_path, "float32")
    worst = 0.0
    for prompt, gen in zip(prompts, gens, strict=True):
        tokens = torch.tensor([prompt + gen.tokens])
        with torch.no_grad():
            lp, _ = token_log_probs(model(tokens).logits[:, :-1], tokens[:, 1:],
                                    log_prob_temperature(temperature))
        trained = lp[0, len(prompt) - 1:]
        worst = max(worst, (trained - torch.tensor(gen.log_probs)).abs().max().item())
    assert worst < 1e-4  # a KV-cache loop and a full forward differ by ~1e-6 in fp32


def test_sample_seeds_are_numpys_seed_sequence_value_for_value():
    """The batched seeding (relax.rollout.sample_seeds) gives what one SeedSequence per engine
    call gave, so every recorded run and test keeps its numbers: seeds of one and two 32-bit
    words, negative ones (mod 2**64), indices and call numbers up to 2**32 - 1."""
    import numpy as np

    from relax.rollout import sample_seeds

    def seed_sequence(seed, index, call=0):
        entropy = [seed % 2**64, index] + ([call] if call else [])
        return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> 2)

    rng = random.Random(0)
    seeds = [0, 1, 2**32 - 1, 2**32, 2**63 + 5, -1, 2**64 - 1, 7 * 1_000_003 + 3,
             *(rng.randrange(-2**70, 2**70) for _ in range(20))]
    for seed in seeds:
        indices = [0, 1, 255, 2**32 - 1, *(rng.randrange(2**32) for _ in range(12))]
        calls = [0, 2, 0, 2**32 - 1, *(rng.choice([0, 1, 3]) for _ in range(12))]
        want = [seed_sequence(seed, i, c) for i, c in zip(indices, calls)]
        assert sample_seeds(seed, indices, calls) == want
        assert sample_seeds(seed, [255], [1]) == [seed_sequence(seed, 255, 1)]
        assert prompt_seeds(seed, 4, first_index=8) == [seed_sequence(seed, i) for i in range(8, 12)]
    assert sample_seeds(1, []) == []
    assert prompt_seeds([4, 5], 2) == [4, 5]  # an EngineClient's seeds, one per prompt
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        prompt_seeds([4, 5], 3)
    with pytest.raises(ValueError, match="32 bits"):
        sample_seeds(1, [2**32])


def test_weights_go_in_buckets_of_at_most_the_limit_in_order():
    """rollout.weight_update_bucket_mb: tensors in order, a bucket filled up to the limit exactly; a
    tensor over the limit alone in a bucket of its own, never after an empty one."""
    from relax.rollout import buckets

    def tensors(**sizes):
        return {name: torch.zeros(n, dtype=torch.uint8) for name, n in sizes.items()}

    out = buckets(tensors(a=40, b=60, c=30, d=150, e=10, f=90), 100)
    assert [list(b) for b in out] == [["a", "b"], ["c"], ["d"], ["e", "f"]]
    assert [list(b) for b in buckets(tensors(big=200, x=1), 100)] == [["big"], ["x"]]


def test_sampling_is_seeded_and_top_p_restricts(tiny_path, tokenizer):
    engine = engine_for(tiny_path, tokenizer)
    prompts = chat_prompts(tokenizer, 64)
    a = engine.generate(prompts, SamplingParams(1.0, 1.0, 8), seed=5)
    b = engine.generate(prompts, SamplingParams(1.0, 1.0, 8), seed=5)
    c = engine.generate(prompts, SamplingParams(1.0, 1.0, 8), seed=6)
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.tokens for g in a] != [g.tokens for g in c]
    tiny_p = engine.generate(prompts, SamplingParams(1.0, 1e-6, 8), seed=5)
    greedy = engine.generate(prompts, SamplingParams(0.0, 1.0, 8), seed=0)
    assert [g.tokens for g in tiny_p] == [g.tokens for g in greedy]


def test_each_step_draws_the_next_uniform_of_its_samples_own_stream(tiny_path, tokenizer):
    """Sample i's token t is the inverse CDF of softmax(logits / T) at torch.rand(N, seed_i)[t]
    (seed_i = prompt_seeds(seed, n)[i]): a fresh uniform every step, from its own seed's stream."""
    prompts, sp = chat_prompts(tokenizer, 6, 1, 999, seed=2), SamplingParams(0.8, 1.0, 6)
    gens = engine_for(tiny_path, tokenizer).generate(prompts, sp, seed=11)
    model = load_causal_lm(tiny_path, "float32")
    for prompt, gen, seed in zip(prompts, gens, prompt_seeds(11, 6), strict=True):
        uniforms = torch.rand(6, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen.tokens])).logits[0, len(prompt) - 1:].float()
        cdf = (logits / 0.8).softmax(-1).cumsum(-1)
        want = [torch.searchsorted(cdf[t], uniforms[t:t + 1] * cdf[t, -1], right=True).item()
                for t in range(len(gen.tokens))]
        assert gen.tokens == want


def test_top_p_samples_the_nucleus_in_proportion():
    """A token stays while the probability mass before it (tokens sorted, most likely first) is at
    most top_p (SGLang's rule, ties kept); the draw is the renormalised nucleus' inverse CDF at the
    row's uniform; the log-prob is the token's under the whole softmax. A uniform of exactly 0
    (torch.rand can draw it) takes the first token with any probability, never a dropped one."""
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])  # sorted: 1, 2, 3, 0; mass before 0, .5, .8, .95
    logits = probs.log()[None].expand(4000, -1)
    uniforms = (torch.arange(4000) + 0.5) / 4000
    tokens, logp = TorchEngine._sample(logits, SamplingParams(1.0, 0.6, 8), uniforms)
    assert tokens.unique().tolist() == [1, 2]
    assert (tokens == 1).float().mean().item() == pytest.approx(0.5 / 0.8, abs=1e-3)
    assert torch.equal(logp, probs.log().log_softmax(-1)[tokens])
    whole = probs.log().log_softmax(-1).exp()
    ordered = whole.sort(descending=True).values
    before_3 = (ordered.cumsum(-1) - ordered)[2].item()  # the mass before token 3, exactly as computed
    tokens, _ = TorchEngine._sample(logits, SamplingParams(1.0, before_3, 8), uniforms)
    assert tokens.unique().tolist() == [1, 2, 3]
    assert (tokens == 3).float().mean().item() == pytest.approx(0.15 / 0.95, abs=1e-3)
    zero, _ = TorchEngine._sample(probs.log()[None], SamplingParams(1.0, 0.6, 8), torch.zeros(1))
    assert zero.tolist() == [1]


def test_a_second_engine_draws_its_share_of_the_rollout_as_one_engine_would(tiny_path, tokenizer):
    """rollout.num_engines > 1: the engine given prompts first_index.. draws them with those samples'
    seeds, so the rollout does not depend on how it is split."""
    engine, prompts = engine_for(tiny_path, tokenizer), chat_prompts(tokenizer, 8)
    sp = SamplingParams(1.0, 1.0, 8)
    whole = engine.generate(prompts, sp, seed=5)
    second = engine.generate(prompts[5:], sp, seed=5, first_index=5)
    assert [g.tokens for g in second] == [g.tokens for g in whole[5:]]
    diffs = [abs(a - b) for g, h in zip(second, whole[5:]) for a, b in zip(g.log_probs, h.log_probs)]
    assert max(diffs) < 1e-5  # another batch: rounding only


def test_truncated_status_at_max_new_tokens(tiny_path, tokenizer):
    gens = engine_for(tiny_path, tokenizer).generate(
        chat_prompts(tokenizer, 8), SamplingParams(0.0, 1.0, 1), seed=0)
    assert all(g.status == "truncated" and len(g.tokens) == 1 for g in gens)


def test_update_weights_rejects_unknown_names_and_shapes(tiny_path, tokenizer):
    engine = engine_for(tiny_path, tokenizer)
    with pytest.raises(KeyError, match="no tensor named"):
        engine.update_weights({"model.bogus.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({"model.norm.weight": torch.zeros(3)})


@pytest.fixture(scope="module")
def moe_path():
    """A tiny Qwen2-MoE (4 experts, top-2; random weights are enough to compare kernels)."""
    from relax.model import resolve_model_path

    return resolve_model_path(make_cfg("model.tiny.num_experts=4", "model.tiny.warmup_max_steps=0",
                                       "model.tiny.shared_expert_intermediate_size=64").model)


def test_moe_model_greedy_and_log_probs_match_hf(moe_path, tokenizer):
    prompts = chat_prompts(tokenizer, 12, 1, 999, repeat=2)
    engine = engine_for(moe_path, tokenizer)
    greedy = engine.generate(prompts, SamplingParams(0.0, 1.0, 6), seed=0)
    model = load_causal_lm(moe_path, "float32")
    for prompt, gen in zip(prompts, greedy, strict=True):
        assert gen.tokens == hf_greedy(model, prompt, tokenizer, 6)
    sampled = engine.generate(prompts, SamplingParams(1.0, 1.0, 6), seed=1)
    for prompt, gen in zip(prompts, sampled, strict=True):
        tokens = torch.tensor([prompt + gen.tokens])
        with torch.no_grad():
            lp, _ = token_log_probs(model(tokens).logits[:, :-1], tokens[:, 1:])
        assert (lp[0, len(prompt) - 1:] - torch.tensor(gen.log_probs)).abs().max() < 1e-4


@pytest.mark.parametrize("override,message", [
    ("rollout.top_p=0.0", r"rollout.top_p=0.0: expected a probability in \(0, 1\]"),
    ("rollout.temperature=-0.1", r"rollout.temperature=-0.1: expected a number >= 0 \(0: greedy\)"),
    ("rollout.max_new_tokens=0", r"rollout.max_new_tokens=0: expected a positive integer"),
    ("rollout.num_engines=0", r"rollout.num_engines=0: expected at least 1 \(or null\)"),
])
def test_rollout_values_no_run_can_use_are_refused_at_their_bounds(override, message):
    from relax.errors import ConfigError
    from relax.rollout import check_engine, check_rollout

    cfg = make_cfg(override)
    with pytest.raises(ConfigError, match=message):
        check_rollout(cfg.rollout)
        check_engine(cfg.rollout, cfg.model, cfg.algo, cfg.debug)


def test_greedy_and_top_p_1_are_valid_sampling_and_reach_the_engine():
    from relax.rollout import check_engine, check_rollout

    cfg = make_cfg("rollout.temperature=0", "rollout.top_p=1.0", "rollout.num_engines=1",
                   "rollout.max_new_tokens=1")
    check_rollout(cfg.rollout)
    check_engine(cfg.rollout, cfg.model, cfg.algo, cfg.debug)
    cfg = make_cfg("rollout.temperature=0.6", "rollout.top_p=0.9", "rollout.max_new_tokens=5")
    assert SamplingParams.of(cfg.rollout) == SamplingParams(0.6, 0.9, 5)


def test_log_probs_of_greedy_sampling_are_the_unscaled_softmaxs():
    assert log_prob_temperature(0.0) == 1.0 and log_prob_temperature(0) == 1.0  # not a division by 0
    assert log_prob_temperature(0.7) == 0.7 and log_prob_temperature(1.0) == 1.0


def test_nccl_weight_sync_is_refused_without_gpus():
    from relax.debug.plan import resolve
    from relax.errors import ConfigError

    if torch.cuda.is_available():
        pytest.skip("GPUs present: the mode is allowed")
    with pytest.raises(ConfigError, match="needs rollout=sglang and CUDA GPUs"):
        resolve(make_cfg("rollout=sglang", "rollout.weight_update_mode=distributed"))


def test_nccl_weight_sync_sends_what_its_metadata_names_in_order_on_the_engines_group(monkeypatch):
    """relax/train/weight_sync.py without GPUs: SGLang's process group and NCCL's broadcast are
    recorded, not run. A LoRA trainer syncs only the merged projections: its metadata and its
    broadcast both hold those, in the same order, on the group of the engine being updated."""
    import sys
    import types

    from relax.train import weight_sync
    from relax.train.weight_sync import DistributedWeightSync

    class Weight:  # a tensor whose .to("cuda") says which it is
        def __init__(self, name, dtype, shape):
            self.name, self.dtype, self.shape = name, dtype, torch.Size(shape)

        def to(self, device, non_blocking=False):
            return (self.name, device)

    weights = {n: Weight(n, dt, sh) for n, dt, sh in [("embed", torch.float32, (8, 4)),
                                                      ("q_proj", torch.bfloat16, (4, 4)),
                                                      ("k_proj", torch.bfloat16, (2, 4))]}

    class Trainer(DistributedWeightSync):
        def named_weights(self):
            return weights

        def synced_weights(self):
            return {n: weights[n] for n in ("q_proj", "k_proj")}

    created, sent = [], []
    sglang_utils = types.ModuleType("sglang.srt.utils")
    sglang_utils.init_custom_process_group = lambda **kw: created.append(kw) or f"group{len(created)}"
    for name, module in [("sglang", types.ModuleType("sglang")),
                         ("sglang.srt", types.ModuleType("sglang.srt")), ("sglang.srt.utils", sglang_utils)]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(weight_sync.dist, "broadcast",
                        lambda t, src, group=None: sent.append((t, src, group)))
    monkeypatch.setattr(weight_sync.torch.cuda, "synchronize", lambda: None)

    trainer = Trainer()
    assert trainer.weight_metadata() == [("q_proj", "bfloat16", [4, 4]), ("k_proj", "bfloat16", [2, 4])]
    for i in range(2):
        trainer.init_weight_sync_group("10.0.0.1", 29500 + i, 3, f"engine{i}")
    assert created == [{"backend": "nccl", "init_method": f"tcp://10.0.0.1:{29500 + i}", "world_size": 3,
                        "rank": 0, "group_name": f"engine{i}"} for i in range(2)]
    trainer.broadcast_weights("engine1")
    assert sent == [(("q_proj", "cuda"), 0, "group2"), (("k_proj", "cuda"), 0, "group2")]
    # ranks other than 0 join no group and send nothing (their part is gathering the weights)
    monkeypatch.setattr(weight_sync.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(weight_sync.dist, "get_rank", lambda: 1)
    other = Trainer()
    other.init_weight_sync_group("10.0.0.1", 29502, 3, "engine0")
    other.broadcast_weights("engine0")
    assert len(created) == 2 and len(sent) == 2


def test_the_weight_check_on_tensor_parallel_sglang_engines_is_refused_at_start():
    from relax.debug.plan import resolve
    from relax.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.rollout_num_gpus_per_engine=1"):
        resolve(make_cfg("rollout=sglang", "rollout.rollout_num_gpus=4",
                         "rollout.rollout_num_gpus_per_engine=2", "debug.check_weight_update_equal=true"))


def test_sglang_deterministic_mode_seeds_each_sample():
    """Seeds per prompt: reproducible from the rollout seed, distinct within a GRPO group."""
    from relax.rollout.sglang_engine import sglang_sampling_params as sampling_params

    sp = SamplingParams(1.0, 1.0, 8)
    assert "sampling_seed" not in sampling_params(sp, [2], seed=7, n=16, deterministic=False)
    seeded = sampling_params(sp, [2], seed=7, n=16, deterministic=True)
    seeds = [p["sampling_seed"] for p in seeded]
    assert len(set(seeds)) == 16 and all(0 <= s < 2**62 for s in seeds)
    assert seeds == [p["sampling_seed"] for p in sampling_params(sp, [2], 7, 16, True)]
    assert not set(seeds) & {p["sampling_seed"] for p in sampling_params(sp, [2], 8, 16, True)}
    assert all(p["temperature"] == 1.0 and p["stop_token_ids"] == [2] for p in seeded)
