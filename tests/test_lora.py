"""LoRA (train.lora.*, relax/train/lora.py): only the adapters train, the reference is the base with
them off, engines and checkpoints get the merged model, and resume, layouts, layer dumps and the
start-up refusals hold with it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from relax.debug.checks import diagnose
from relax.debug.run_data import load_run
from relax.errors import ConfigError
from relax.files import safe_load
from relax.rollout.generate import generate_rollout
from relax.rollout.torch_engine import TorchEngine
from relax.task import build_task

from . import extras
from .conftest import engine_spec, local_trainer, make_cfg, run_loop, trainer_checks
from .test_layouts import compare, replay_dir, sweep  # noqa: F401 (replay_dir: a fixture)
from .test_startup import relax_without

peft = extras.needs("peft", extras.LORA, name="peft")

LORA = ["train.lora.rank=8"]
SHORT = ["rollout.rollout_batch_size=8", "checkpoint.save_interval=null"]
PROJECTION_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROJECTIONS = {f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}.weight"
               for i in range(2) for p in PROJECTION_NAMES}


def test_only_the_adapters_train_and_the_first_step_is_the_frozen_base(tiny_path, tokenizer):
    cfg = make_cfg("rollout.rollout_batch_size=8", "algo.use_kl_loss=true", "algo.kl_loss_coef=0.1", *LORA)
    engine = TorchEngine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    trainer = local_trainer(cfg, str(tiny_path), ref_model_path=str(tiny_path),
                           pad_token_id=tokenizer.pad_token_id)
    assert trainer.ref is None  # the reference is the actor with its adapters off: one copy of the weights
    adapters = dict(trainer.lora.parameters())
    assert len(adapters) == 2 * len(PROJECTIONS)
    assert [p for g in trainer.optimizer.param_groups for p in g["params"]] == list(adapters.values())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    def changed():
        return {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}

    task = build_task(cfg.task, cfg.seed)
    out = trainer.train(0, generate_rollout(engine, task, tokenizer, cfg.rollout, 0, cfg.seed)[0])
    r, step = out["rollout"], out["steps"][0]
    assert r["rollout/log_probs"] == r["rollout/ref_log_probs"] and r["rollout/kl"] == 0.0
    assert step["train/ppo_kl"] == 0.0 and step["train/kl_loss"] == 0.0 and step["train/grad_norm"] > 0
    assert changed() == {n for n in adapters if ".lora_B." in n}  # B starts at 0, so A's first gradient is 0
    out = trainer.train(1, generate_rollout(engine, task, tokenizer, cfg.rollout, 1, cfg.seed)[0])
    assert out["rollout"]["rollout/kl"] != 0  # the adapters moved the actor off the base
    assert changed() == set(adapters)  # and the base weights are bit-identical

    # engines get the merged model under HF names; a sync sends the projections, as merged
    weights, synced = trainer.named_weights(), trainer.synced_weights()
    assert weights.keys() == engine.params.keys() and synced.keys() == PROJECTIONS
    assert all(torch.equal(synced[n], weights[n]) for n in synced)
    base = {n: before[n.replace(".weight", ".base_layer.weight")] for n in synced}
    assert not any(torch.equal(weights[n], base[n]) for n in synced)
    engine.update_weights(synced)  # the engine now holds the whole merged model
    assert all(torch.equal(engine.params[n], t) for n, t in weights.items())
    prompt = torch.tensor([tokenizer.encode("<|user|>12+34=<|assistant|>")])
    with torch.no_grad():
        from transformers import AutoModelForCausalLM

        merged = AutoModelForCausalLM.from_pretrained(str(tiny_path))
        merged.load_state_dict(weights)
        diff = (merged(prompt).logits - trainer.model(prompt).logits).abs().max().item()
    assert diff < 1e-4  # the merged model computes what the adapters do (fp32 rounding apart)


def test_a_lora_twin_moves_the_base_by_one_ulp_and_its_reference_with_it(tiny_path, tokenizer):
    """parallel=twin with LoRA: every base weight one ulp from the checkpoint's, up or down, the
    adapters as they start (B = 0); the reference, the same base with its adapters off, moved with
    it: the first step's log_probs are its ref_log_probs, KL 0 (without LoRA the reference is a
    copy loaded unmoved)."""
    cfg = make_cfg("parallel=twin", "rollout.rollout_batch_size=8", *LORA)
    trainer = local_trainer(cfg, str(tiny_path), ref_model_path=str(tiny_path),
                           pad_token_id=tokenizer.pad_token_id)
    checkpoint, merged = load_file(tiny_path / "model.safetensors"), trainer.named_weights()
    assert merged.keys() == checkpoint.keys()
    for name, w in checkpoint.items():
        up, down = torch.nextafter(w, torch.tensor(torch.inf)), torch.nextafter(w, torch.tensor(-torch.inf))
        assert torch.equal(merged[name], torch.where(merged[name] > w, up, down)), name
        assert (merged[name] > w).any() and (merged[name] < w).any(), name  # random directions
    assert all(not p.any() for n, p in trainer.lora.parameters() if ".lora_B." in n)
    engine = TorchEngine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    out = trainer.train(0, generate_rollout(engine, build_task(cfg.task, cfg.seed), tokenizer, cfg.rollout, 0, cfg.seed)[0])
    assert out["rollout"]["rollout/log_probs"] == out["rollout"]["rollout/ref_log_probs"]
    assert out["rollout"]["rollout/kl"] == 0.0 and out["steps"][0]["train/ppo_kl"] == 0.0


def test_adapter_dropout_runs_in_the_actors_forward_and_not_in_the_references(tiny_path):
    """The trainer keeps the model in eval mode (a deterministic forward), which would silently switch
    train.lora.dropout off."""
    trainer = local_trainer(make_cfg(*LORA, "train.lora.dropout=0.5"), str(tiny_path))
    tokens = torch.tensor([[2, 11, 12, 13, 14, 15, 3]])
    with torch.no_grad():
        for name, p in trainer.lora.parameters():
            if ".lora_B." in name:
                p.normal_()  # (B = 0 would hide the dropout)
        assert not torch.equal(trainer.model(tokens).logits, trainer.model(tokens).logits)
        with trainer.lora.disabled() as reference:
            assert torch.equal(reference(tokens).logits, reference(tokens).logits)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_path):
    run = tmp_path_factory.mktemp("lora")
    run_loop(run, *LORA, "rollout.rollout_batch_size=8", "rollout.num_rollout=3", "debug=dump",
             "checkpoint.save_interval=3", "train.lora.save_merged=true",
             "debug.check_weight_update_equal=true",
             "debug.check_weight_update_every_sync=true", "debug.strict_checks=true")
    return run


def test_a_lora_run_passes_the_doctors_checks_and_the_strict_weight_check_every_sync(lora_run, tiny_path):
    checks = {c.id: c for c in diagnose(load_run(lora_run))}
    for i in (3, 4, 5, 6):  # log_probs == ref_log_probs, first-step KL 0, train vs rollout, engine weights
        assert checks[i].verdict == "PASS", (i, checks[i].summary)
    report = json.loads((lora_run / "weight_check.json").read_text())
    assert report["passed"] and [c["stage"] for c in report["checks"]] == ["load"] + ["sync"] * 4
    assert {c["compared"] for c in report["checks"][1:]} == {28}  # every tensor, not only the synced ones
    checkpoint = lora_run / "checkpoints" / "rollout_000002"
    config = json.loads((checkpoint / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    assert sorted(config["target_modules"]) == sorted(PROJECTION_NAMES)
    adapter = load_file(checkpoint / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 28 and all(k.startswith("base_model.model.model.layers.") for k in adapter)
    # peft loads the adapter onto the base, and computes what the merged hf/ model computes
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, merged = (AutoModelForCausalLM.from_pretrained(p) for p in (tiny_path, checkpoint / "hf"))
    tokens = torch.tensor([[2, 11, 12, 13, 14, 15, 3]])
    with torch.no_grad():
        before = base(tokens).logits
        adapted = PeftModel.from_pretrained(base, checkpoint / "adapter")(tokens).logits
        assert (adapted - merged(tokens).logits).abs().max() < 1e-4 and not torch.equal(adapted, before)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"])
def test_lora_on_every_family_syncs_the_merged_model(family_model, tmp_path, family):
    """The default targets are what each family has: an MoE layer's shared expert and attention, not
    its fused experts; tied embeddings stay tied (the embedding is not adapted)."""
    rollouts, steps = run_loop(tmp_path, *LORA, "model=hf", f"model.path={family_model(family)}",
                               "rollout.num_rollout=2", "rollout.rollout_batch_size=2",
                               "rollout.n_samples_per_prompt=4", "checkpoint.save_interval=2",
                               "debug.check_weight_update_equal=true",
                               "debug.check_weight_update_every_sync=true")
    assert rollouts[0]["rollout/kl"] == 0.0 and steps[0]["train/ppo_kl"] == 0.0
    assert json.loads((tmp_path / "weight_check.json").read_text())["passed"]
    adapted = {k.split(".lora_")[0].removeprefix("base_model.model.") for k in load_file(
        tmp_path / "checkpoints" / "rollout_000001" / "adapter" / "adapter_model.safetensors")}
    assert {n.rsplit(".", 1)[-1] for n in adapted} == (
        {"q_proj", "k_proj", "v_proj", "o_proj"} if family == "qwen3_moe" else set(PROJECTION_NAMES))
    assert not any(".experts." in n for n in adapted)


def test_a_sync_that_leaves_the_adapters_out_of_the_merge_is_caught(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_FAULT", "lora_sync_unmerged")
    run_loop(tmp_path, *LORA, *SHORT, "rollout.num_rollout=2", "debug.check_weight_update_equal=true",
             "debug.check_weight_update_every_sync=true")
    report = json.loads((tmp_path / "weight_check.json").read_text())
    assert not report["passed"]
    first, *later = [c for c in report["checks"] if c["rollout_id"] is not None]
    assert {m["name"] for m in first["mismatches"]} == PROJECTIONS  # the engine kept the base projections
    checks = {c.id: c for c in diagnose(load_run(tmp_path))}
    assert checks[6].verdict == "FAIL" and "model.layers." in checks[6].summary


SHARDED = [pytest.param(x, marks=pytest.mark.slow) for x in ("fsdp2", "tp2")]  # rank processes: 25 s each


@pytest.mark.parametrize("layout", ["single", *SHARDED])
def test_a_resumed_lora_run_ends_with_the_adapter_of_an_uninterrupted_one(tmp_path, layout):
    common = [*LORA, f"parallel={layout}", "rollout.num_rollout=4", "rollout.rollout_batch_size=8",
              "checkpoint.save_interval=2", "checkpoint.keep_last=3", "train.ref_log_probs_interval=2"]
    full_rollouts, full_steps = run_loop(tmp_path / "full", *common)
    middle = tmp_path / "full" / "checkpoints" / "rollout_000001"
    resumed_rollouts, resumed_steps = run_loop(tmp_path / "resumed", *common, f"resume={middle}")
    for resumed, full in zip(resumed_steps, full_steps, strict=True):
        for key in ("train/loss", "train/grad_norm", "train/ppo_kl"):
            assert resumed[key] == full[key], key
    # rollout 2's reference is the base (the adapters off), not the merged model the engine loaded
    assert resumed_rollouts[2]["rollout/ref_log_probs"] == full_rollouts[2]["rollout/ref_log_probs"]
    assert resumed_rollouts[2]["rollout/kl"] == full_rollouts[2]["rollout/kl"] != 0
    last = [run / "checkpoints" / "rollout_000003" for run in (tmp_path / "full", tmp_path / "resumed")]
    a, b = (load_file(c / "adapter" / "adapter_model.safetensors") for c in last)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the adapter alone (train.lora.save_merged=false): 28 small tensors, no second copy of the model
    assert not any((c / "hf").exists() for c in [middle, *last])
    state = safe_load(last[1] / "trainer_state.pt")["optimizer"]["state"]
    assert state and all(".lora_" in name for name in state)  # Adam's moments: the adapters' only

    with pytest.raises(ConfigError, match=r"train.lora.rank=0 \(the run: 8\) would make another experiment"):
        run_loop(tmp_path / "full_ft", *common[1:], f"resume={middle}")
    with pytest.raises(ConfigError, match="train.lora="):  # its state is the adapters': not a full run's
        run_loop(tmp_path / "full_ft", *common[1:], f"resume={middle}", "resume_allow_changes=[train.lora]")


def test_lora_layouts_match_single_and_dump_gradients_under_peft_names(tmp_path, replay_dir):  # noqa: F811
    proc, multirun = sweep(tmp_path, replay_dir, "single,dp2,fsdp2,tp2,dp2tp2", *LORA,
                           "debug.dump_layers=${hydra:runtime.output_dir}/layers")
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, report = compare(multirun)
    assert code == 0, report
    jobs = {j["name"]: j for j in report["jobs"]}
    for name in ("parallel=dp2", "parallel=fsdp2", "parallel=tp2", "parallel=dp2tp2"):
        assert jobs[name]["verdict"] == "equivalent" and jobs[name]["max_logprob_diff"] <= 1e-5, jobs[name]
    code, report = compare(multirun, args=("--layers",))
    assert code == 0 and not any(j["departs"] for j in report["jobs"]), report
    dump = safe_load(multirun / "parallel=single" / "layers" / "0_train.pt")
    assert set(dump["grads"]) == {n.removesuffix(".weight") + f".lora_{x}.default.weight"
                                  for n in PROJECTIONS for x in "AB"}  # only the adapters train
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in dump["params"]
    assert not any(n.startswith("base_model") for n in [*dump["grads"], *dump["params"]])


@pytest.mark.parametrize("args, message", [
    (["train.lora.rank=-1"], "train.lora.rank=-1: expected 0 (LoRA off) or a positive adapter rank"),
    ([*LORA, "train.lora.alpha=0"], "train.lora.alpha=0.0: expected a number > 0, or null (2 x rank)"),
    ([*LORA, "train.lora.dropout=1"], "train.lora.dropout=1.0: expected a probability in [0, 1)"),
    ([*LORA, "train.lora.target_modules=[q_proj,qproj]"], "train.lora.target_modules: 'qproj' matches no "
     "module of the model; its linear layers are named down_proj, gate_proj, k_proj, lm_head, o_proj"),
    ([*LORA, "train.lora.target_modules=[mlp]"], "train.lora.target_modules: 'mlp' names model.layers.0.mlp "
     "(Qwen2MLP), model.layers.1.mlp (Qwen2MLP), not a linear layer"),
    ([*LORA, "train=megatron"], "train.lora.rank=8: LoRA trains with train=torch only, and train._target_="
     "relax.train.megatron.trainer.MegatronTrainer has no LoRA (Megatron-core has none of its own)"),
], ids=["rank", "alpha", "dropout", "no-match", "not-linear", "megatron"])
def test_bad_lora_settings_exit_2_naming_the_key(tmp_path, fork_cli, args, message):
    proc = fork_cli(tmp_path, *args, *SHORT)
    proc.join()
    output = (tmp_path / "out.log").read_text()
    assert proc.exitcode == 2 and message in output and "Traceback" not in output, output[-3000:]


def test_the_layout_matching_the_tp_plan_and_the_merge_by_hand(tiny_path):
    """What a checkpoint is tied to (rank, alpha: 2 x rank by default, targets), peft's name rule
    (a whole dotted part), the TP plan of wrapped projections (colwise: B sharded, rowwise: A), a
    tied lm_head refused, and the merge: W + scaling x B @ A in W's dtype, the adapters dropped."""
    from types import SimpleNamespace

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from relax.model import read_hf_config
    from relax.train.lora import Adapters, check_targets, layout, matches
    from relax.train.parallel import tp_plan

    lora = make_cfg(*LORA).train.lora
    assert layout(lora) == {"rank": 8, "alpha": 16.0, "target_modules": None}
    assert layout(make_cfg().train.lora) is None
    assert matches("model.layers.0.self_attn.q_proj", "q_proj") and matches("lm_head", "lm_head")
    assert not matches("model.layers.0.self_attn.q_proj", "proj")
    with pytest.raises(ConfigError, match="lm_head shares its weight with the embedding"):
        check_targets(make_cfg(*LORA, "train.lora.target_modules=[lm_head]").train.lora,
                      {**read_hf_config(tiny_path), "tie_word_embeddings": True})

    layer = torch.nn.Module()
    layer.attn = torch.nn.Module()
    layer.attn.k_proj = torch.nn.Linear(2, 2)  # not adapted
    for name in ("q_proj", "o_proj"):
        setattr(layer.attn, name, torch.nn.Module())
        getattr(layer.attn, name).base_layer = torch.nn.Linear(2, 2)
    col, row = ColwiseParallel(), RowwiseParallel()
    assert tp_plan(layer, {"attn.q_proj": col, "attn.k_proj": col, "attn.o_proj": row}) == {
        "attn.q_proj.base_layer": col, "attn.q_proj.lora_B.default": col, "attn.k_proj": col,
        "attn.o_proj.base_layer": row, "attn.o_proj.lora_A.default": row}

    adapters = Adapters.__new__(Adapters)  # the merge reads each adapted layer's scaling only
    adapters.layers = {"p": SimpleNamespace(scaling={"default": 2.0})}
    w = torch.ones(3, 2, dtype=torch.bfloat16)
    a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0], [0.0], [3.0]])
    merged = adapters.merge({"p.base_layer.weight": w, "p.lora_A.default.weight": a,
                             "p.lora_B.default.weight": b, "norm.weight": torch.zeros(2)})
    assert merged.keys() == {"p.weight", "norm.weight"} and merged["p.weight"].dtype == torch.bfloat16
    assert merged["p.weight"].tolist() == [[3.0, 5.0], [1.0, 1.0], [7.0, 13.0]]


def test_an_adapter_peft_puts_on_fused_experts_is_refused(family_model):
    """Qwen3-MoE with a dense layer 0: its MLP names are linear layers there, and peft takes them for
    the MoE layers' fused experts too (3-D parameters, transformers 5's layout), which no merge here
    handles; the family's default (attention) passes."""
    from relax.model import read_hf_config

    hf = {**read_hf_config(family_model("qwen3_moe")), "mlp_only_layers": [0]}
    trainer_checks(make_cfg(*LORA), hf)
    with pytest.raises(ConfigError, match=r"peft adapts model\.layers\.1\.mlp\.experts.* \(ParamWrapper: "):
        trainer_checks(make_cfg(*LORA, "train.lora.target_modules=[q_proj,gate_proj,up_proj,down_proj]"), hf)


def test_lora_without_peft_names_the_extra(tmp_path):
    proc = relax_without(tmp_path, ["peft"], *LORA, *SHORT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert "train.lora.rank=8 needs the module 'peft'" in output
    assert "install the [lora] extra: pip install -c constraints.txt -e '.[lora]'" in output


@pytest.mark.sglang
@pytest.mark.parametrize("mode", ["tensor", "disk"])
def test_sglang_serves_the_merged_model_after_every_sync(tmp_path, mode):
    """The merged projections alone into SGLang, by name; the engine then equals the whole merged
    model (the strict engine-weights check, buffers included)."""
    pytest.importorskip("sglang", reason="needs the SGLang environment (scripts/setup_sglang_cpu.sh)")
    _, steps = run_loop(tmp_path, *LORA, "rollout=sglang", f"rollout.weight_update_mode={mode}",
                        "rollout.num_rollout=2", "rollout.rollout_batch_size=4",
                        "checkpoint.save_interval=null", "debug.check_weight_update_equal=true",
                        "debug.check_weight_update_every_sync=true", "debug.strict_checks=true")
    report = json.loads((tmp_path / "weight_check.json").read_text())
    assert report["passed"] and [c["rollout_id"] for c in report["checks"]] == [None, None, 0, 1]
    assert steps[1]["train/train_rollout_logprob_abs_diff"] < 1e-4  # SGLang sampled from the merged model


@pytest.mark.slow
def test_the_tiny_default_learns_with_lora(tmp_path):
    """Measured once (docs/lora.md): mean reward of the first 3 rollouts vs the last 3."""
    rollouts, _ = run_loop(tmp_path, *LORA, "checkpoint.save_interval=null")
    rewards = [r["rollout/raw_reward"] for r in rollouts]
    assert len(rewards) == 400
    assert sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 > 0.3  # measured: 0.335 -> 0.871


def test_an_adapter_only_checkpoint_resumes_with_the_merged_model_in_the_engine(tmp_path, tiny_path):
    """Without train.lora.save_merged a checkpoint holds the adapter, not the merged model: the
    resumed engine loads the base and gets base + adapter from the trainer, which the strict
    engine-weights check confirms; train.lora.save_merged=true writes the merged hf/ dir too."""
    common = [*LORA, *SHORT, "rollout.num_rollout=3", "checkpoint.save_interval=2"]
    full, _ = run_loop(tmp_path / "full", *common)
    checkpoint = tmp_path / "full" / "checkpoints" / "rollout_000001"
    assert (checkpoint / "adapter").is_dir() and not (checkpoint / "hf").exists()
    resumed, _ = run_loop(tmp_path / "resumed", *common, f"resume={checkpoint}", "debug.strict_checks=true",
                          "debug.check_weight_update_equal=true", "debug.check_weight_update_every_sync=true")
    report = json.loads((tmp_path / "resumed" / "weight_check.json").read_text())
    assert report["passed"] and [c["stage"] for c in report["checks"]][:2] == ["load", "sync"]
    # the engine served base + adapter: its rollout 2 equals the uninterrupted run's
    assert resumed[2]["rollout_id"] == full[2]["rollout_id"] == 2
    assert resumed[2]["rollout/raw_reward"] == full[2]["rollout/raw_reward"]
    with pytest.raises(ConfigError, match="only a trainer merges"):
        run_loop(tmp_path / "rollout_only", *common, f"resume={checkpoint}", "debug=rollout_only")
    run_loop(tmp_path / "merged", *common, "train.lora.save_merged=true")
    assert (tmp_path / "merged" / "checkpoints" / "rollout_000001" / "hf" / "model.safetensors").is_file()
