"""Every key of the schema (relax/config.py: RelaxConfig and each option's subclass that a
conf/<group>/<option>.yaml pulls in) tried with a wrong type, zero, a negative and a huge value
(what its type admits; strings and lists with a value no option has), each against the start-up
checks: `relax.startup.prepare`, what a run goes through before anything is built. Each value is
either refused there, by a ConfigError naming the key and the value or Hydra's merge error naming
the key, with nothing written into the run dir, or valid: VALID says why, key by key. A key added
to the schema without a place in VALID or ALWAYS_REFUSED fails test_every_key_is_classified, so
no key skips this walk.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import shutil
import typing
from unittest import mock

import pytest
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from relax import config as schema
from relax.cli import CONF_DIR
from relax.errors import ConfigError

from . import extras
from .conftest import make_cfg

HUGE_INT, HUGE_FLOAT = 10**18, 1e30


def bad_values(kind) -> dict[str, object]:
    """The values a key of type `kind` is tried with, by name."""
    if typing.get_origin(kind) is typing.Union:  # Optional[X]: null is each one's documented default
        (kind,) = [a for a in typing.get_args(kind) if a is not type(None)]
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is bool:
        return {"type": "abc"}
    if kind is int:
        return {"type": "abc", "zero": 0, "negative": -1, "huge": HUGE_INT}
    if kind is float:
        return {"type": "abc", "zero": 0.0, "negative": -1.0, "huge": HUGE_FLOAT, "nan": math.nan}
    if kind is str:
        return {"type": [1], "bogus": "bogus"}
    if origin is list and args == (int,):
        return {"type": "abc", "empty": [], "negative": [-1], "huge": [HUGE_INT]}
    if origin is list and args == (float,):
        return {"type": "abc", "empty": [], "negative": [-1.0], "nan": [math.nan]}
    if origin is list:
        return {"type": 5, "empty": [], "bogus": ["bogus"]}
    if origin is dict:
        return {"type": "abc", "bogus": {"bogus": -1}}
    return {"type": [1], "zero": 0, "negative": -1, "bogus": "bogus"}  # Any


def leaves(node, prefix: str):
    hints = typing.get_type_hints(node, vars(schema))
    for f in dataclasses.fields(node):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", hints[f.name]


def option_of_schema() -> dict[str, str]:
    """relax_schema_<group>_<name> -> the `<group>=<option>` whose YAML file pulls it in."""
    found = {}
    for yaml in sorted(CONF_DIR.glob("*/*.yaml")):
        for name in re.findall(r"/(relax_schema_\w+)@_here_", yaml.read_text()):
            found.setdefault(name, f"{yaml.parent.name}={yaml.stem}")
    return found


def schema_keys() -> dict[str, tuple[object, str | None]]:
    """Every leaf key -> (its type, the option that adds it or None for RelaxConfig's own)."""
    keys = {key: (kind, None) for key, kind in leaves(schema.RelaxConfig, "")}
    options = option_of_schema()
    for name, node in schema.OPTION_SCHEMAS.items():
        option = options[name]
        group = option.split("=")[0]
        for key, kind in leaves(node, f"{group}."):
            keys.setdefault(key, (kind, option))
    return keys


MEMORY = "a size only the machine's memory bounds, which start-up cannot know"
PATH = "a path: any name is one (a relative one lands in the run dir, or the launch dir for the model cache)"
# key -> the tried values (bad_values' names) that are valid for it, and why; every other one must be
# refused at start-up. Every key is in VALID or ALWAYS_REFUSED.
VALID: dict[str, tuple[str, str]] = {
    "seed": ("zero negative huge", "any integer seeds numpy (mod 2**64) and torch (64 bits)"),
    "resume_allow_changes": ("empty bogus", "only a resume reads it; a name that allows nothing leaves the "
                                           "change refused, naming its key"),
    "model.cache_dir": ("bogus", PATH),
    "model.tiny.num_experts": ("zero", "a dense model (the default)"),
    "model.tiny.shared_expert_intermediate_size": ("zero", "no shared expert (the default)"),
    "model.tiny.seed": ("zero negative huge", "any integer seeds the initialisation and the warm-up"),
    "model.tiny.warmup_target_accuracy": ("zero", "the warm-up stops at its first check"),
    "model.tiny.warmup_max_steps": ("zero huge", "a cap (0: the random initialisation, as tests use)"),
    "model.tiny.warmup_batch_size": ("huge", MEMORY),
    "model.tiny.warmup_lr": ("zero huge", "0 leaves the initialisation; a diverging warm-up is refused once "
                                          "built (relax.model.tiny.build: non-finite weights)"),
    "model.package": ("bogus", "fetched and checked at start-up when the model is first used "
                               "(relax/model/gguf.py)"),
    "model.gguf_file": ("bogus", "read from the package at start-up when the model is first used"),
    "model.model_sha256": ("bogus", "compared with the converted model at start-up when it is first used"),
    "rollout.rollout_batch_size": ("huge", MEMORY),
    "rollout.n_samples_per_prompt": ("huge", MEMORY),
    "rollout.temperature": ("zero huge", "0: greedy; a large one samples near-uniformly"),
    "rollout.rollout_num_gpus": ("huge", "a count of GPUs that only GPU engines read (one engine on CPU)"),
    "rollout.num_engines": ("huge", MEMORY),
    "rollout.weight_update_bucket_mb": ("huge", "one bucket holds every weight"),
    "rollout.over_sampling_batch_size": ("huge", MEMORY),
    "rollout.max_generation_rounds": ("huge", "a cap: generation stops once enough groups pass"),
    "rollout.max_total_tokens": ("huge", MEMORY),
    "rollout.sglang_server_args": ("bogus", "passed to SGLang's ServerArgs, which only SGLang's "
                                            "environment has"),
    "train.lr": ("zero huge", "0 trains nothing (a baseline); a large one shows as non-finite steps "
                              "(train.on_nonfinite)"),
    "train.weight_decay": ("zero huge", "decoupled decay: 0 is off, a large one shrinks every weight"),
    "train.adam_beta1": ("zero", "Adam without momentum"),
    "train.adam_beta2": ("zero", "Adam without a running second moment"),
    "train.adam_eps": ("zero huge", "torch's Adam takes 0; a large one makes steps SGD-like and small"),
    "train.micro_batch_size": ("huge", "one micro-batch a step"),
    "train.clip_grad": ("zero huge", "0: no clipping; a large one is never reached"),
    "train.ref_log_probs_interval": ("huge", "the reference runs at the first step only"),
    "train.max_staleness": ("zero huge", "0: synchronous; a large one makes every rollout ahead on the "
                                         "first policy (the run's rollouts fit in memory)"),
    "train.lora.rank": ("zero", "LoRA off (the default)"),
    "train.lora.alpha": ("huge", "a scale of the adapters' update"),
    "train.lora.dropout": ("zero", "no dropout (the default)"),
    "parallel.name": ("bogus", "a label relax compare shows"),
    "parallel.noise_ulp": ("zero", "no noise (the default)"),
    "parallel.step_noise_ulp": ("zero", "no noise (the default)"),
    "algo.eps_clip": ("zero huge", "0: the ratio cannot fall below 1; a large one: no lower clip"),
    "algo.eps_clip_high": ("zero huge", "0: the ratio cannot rise above 1; a large one: no upper clip"),
    "algo.eps_clip_c": ("huge", "the dual clip never binds"),
    "algo.kl_loss_coef": ("zero huge", "a weight: 0 adds no KL term"),
    "algo.entropy_coef": ("zero negative huge", "a weight: 0 off, a negative one penalises entropy"),
    "algo.tis_cap": ("huge", "no importance weight is capped"),
    "algo.behav_imp_weight_cap": ("huge", "decoupled_ppo drops no token"),
    "algo.mis_low": ("zero", "no lower bound: every ratio down to 0 is kept"),
    "algo.mis_high": ("huge", "no upper bound"),
    "task.reward_batch_size": ("huge", "one request a rollout"),
    "task.reward_timeout_s": ("huge", "waits as long as the service takes"),
    "task.reward_retries": ("zero huge", "0: no retry; many: retry until it answers"),
    "task.answer_format": ("bogus", "a regular expression ('bogus' is one; one that does not compile is "
                                    "refused)"),
    "task.format_reward": ("zero negative", "a bonus added to the reward: negative is a penalty"),
    "task.min_operand": ("zero", "0 is an operand"),
    "task.max_operand": ("huge", "longer numbers: each prompt's length is checked as it is made"),
    "task.instruction": ("bogus", "free text appended to each problem"),
    "task.answer_tag": ("bogus", "a tag name: the answer is the text in the response's last <bogus>...</bogus>"),
    "task.answer_regex": ("bogus", "a regular expression: the answer is its last match in the response"),
    "debug.dump_details": ("bogus", PATH),
    "debug.dump_layers": ("bogus", PATH),
    "debug.profile_dir": ("bogus", PATH),
    "logger.backends": ("empty", "metrics.jsonl only (the default)"),
    "logger.wandb_project": ("bogus", "a W&B project name"),
    "logger.wandb_entity": ("bogus", "a W&B team or user name"),
    "eval.interval": ("huge", "evaluates at the last rollout only"),
    "eval.n_samples_per_prompt": ("huge", MEMORY),
    "eval.temperature": ("zero huge", "0: greedy; a large one samples near-uniformly"),
    "checkpoint.save_interval": ("huge", "saves at the last rollout and at a stop only"),
    "checkpoint.keep_last": ("huge", "keeps every checkpoint"),
    "cluster.num_gpus_per_rank": ("zero", "CPU ranks"),
    "cluster.num_gpus_per_engine": ("zero", "CPU engines"),
    "cluster.placement_timeout_s": ("huge", "waits as long as the placement takes"),
    "cluster.runtime_env": ("bogus", "Ray's runtime_env takes plugin fields of any name"),
    "rollout.agent_timeout": ("huge", "waits as long as each agent takes"),
}
ALWAYS_REFUSED = """
resume model.name model.path model.dtype model.tiny.hidden_size model.tiny.num_layers
model.tiny.num_heads model.tiny.num_kv_heads model.tiny.intermediate_size rollout._target_
rollout.num_rollout rollout.top_p rollout.max_new_tokens rollout.dtype rollout.true_on_policy
rollout.rollout_num_gpus_per_engine rollout.weight_update_mode rollout.colocate rollout.generate_fn
rollout.dynamic_sampling_filter rollout.mem_fraction_static rollout.agent rollout.partial
rollout.partial_stale train._target_
train.num_steps_per_rollout train.on_nonfinite train.num_threads train.shared_prompt
train.lora.target_modules train.lora.save_merged train.async train.attention_backend
train.moe_permute_fusion train.deterministic train.use_distributed_optimizer parallel.tp parallel.pp
parallel.vpp parallel.ep parallel.etp parallel.cp parallel.dp parallel.sequence_parallel
parallel.fsdp parallel.world_size algo.advantage_estimator algo.grpo_std_normalization
algo.policy_loss algo.loss_agg_mode algo.use_kl_loss algo.kl_loss_type algo.tis algo.mis
algo.use_rollout_log_probs algo.routing_replay task._target_ task.reward_fn task.group_reward_fn
task.reward_url task.apply_chat_template task.data_path task.operations task.datasets task.weights
task.dataset_kwargs task.size debug.rollout_only
debug.train_only debug.save_rollout_data debug.load_rollout_data debug.load_rollout_data_subsample
debug.allow_manifest_mismatch debug.save_train_data debug.check_weight_update_equal
debug.check_weight_update_every_sync debug.check_weight_sync debug.strict_checks debug.dump_layers_rollouts
debug.dump_layers_samples debug.check_batch_invariance debug.profile_rollouts logger._target_
eval.datasets eval.num_prompts cluster._target_ cluster.address cluster.num_cpus_per_rank
cluster.num_cpus_per_engine cluster.resources_per_rank cluster.resources_per_engine
cluster.placement_strategy cluster.same_node_sockets
""".split()  # every value tried is refused
# what makes a key matter: the other keys its check reads it with (key prefix -> overrides)
CONTEXT = {"train.lora.": ["train.lora.rank=4"], "eval.": ["eval.interval=1"],
           "debug.dump_layers_": ["debug.dump_layers=layers"],
           "debug.profile_rollouts": ["debug.profile_dir=profile"]}
KEYS = schema_keys()


class Built(Exception):
    """The start-up checks passed and the run went on to build what they guard (a model)."""


@pytest.fixture(scope="module")
def start_up(tmp_path_factory, tiny_path):
    """Runs the start-up checks (relax.startup.prepare) on a config with one key set, in a run dir that
    nothing may change, from a launch dir of its own (relative paths land there)."""
    from relax.startup import prepare
    from relax.model import load_tokenizer

    root = tmp_path_factory.mktemp("every_key")
    (root / "prompts.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n' * 4)
    run_dir, bases = root / "run", {}
    run_dir.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setattr("relax.model.tiny.build", mock.Mock(side_effect=Built))  # a tiny recipe: warm-up
        mp.setattr("relax.model.ensure_packaged_model", mock.Mock(side_effect=Built))  # model=smollm2
        mp.setattr("relax.rollout.sglang_engine.require_extra", lambda *a: None)  # rollout=sglang's checks
        tokenizer = load_tokenizer(tiny_path)
        mp.setattr("relax.startup.load_tokenizer", lambda path: tokenizer)

        def check(key: str, value, *more: str) -> Exception | None:
            _, option = KEYS[key]
            overrides = [o for prefix, extra in CONTEXT.items() if key.startswith(prefix) for o in extra]
            overrides += more
            overrides += [option] if option else []
            overrides += ["task.data_path=prompts.jsonl"] if option == "task=jsonl" else []
            if tuple(overrides) not in bases:
                bases[tuple(overrides)] = make_cfg(*overrides, f"model.cache_dir={root / 'cache'}")
            cfg = copy.deepcopy(bases[tuple(overrides)])
            try:
                if isinstance(value, dict):  # a new key in a mapping: `+cluster.resources_per_rank.x=-1`
                    with open_dict(cfg):
                        OmegaConf.update(cfg, key, value, merge=True)
                else:
                    OmegaConf.update(cfg, key, value, merge=True)  # what Hydra does with `key=value`
                prepare(cfg, run_dir)
            except (ConfigError, OmegaConfBaseException) as e:
                assert not list(run_dir.iterdir()), f"{key}={value!r}: refused, yet written into the run dir"
                return e
            except Built:
                pass
            for written in run_dir.iterdir():  # (an accepted dump dir, inside it)
                shutil.rmtree(written)
            return None

        yield check


def test_every_key_is_classified():
    """A key added to relax/config.py (or an option's schema) must get a line in VALID."""
    classified = [*VALID, *ALWAYS_REFUSED]
    assert set(classified) == set(KEYS), (f"unclassified: {sorted(set(KEYS) - set(classified))}; "
                                          f"gone from the schema: {sorted(set(classified) - set(KEYS))}")
    assert len(classified) == len(KEYS)  # no key in both
    for key, (kinds, why) in VALID.items():
        assert why and set(kinds.split()) <= set(bad_values(KEYS[key][0])), key


def shown(value) -> str:
    """How a message shows the value it refuses."""
    if isinstance(value, list):
        return str(value[0]) if value else "[]"
    if isinstance(value, dict):
        return next(iter(value))
    return str(value)


@pytest.mark.parametrize("key", list(KEYS))
def test_each_value_is_refused_naming_the_key_or_valid(key, start_up):
    if KEYS[key][1] == "cluster=ray":  # (without its extra, cluster=ray is refused for that first)
        extras.require("ray", extras.RAY)
    if key.startswith("train.lora."):
        extras.require("peft", extras.LORA)
    if KEYS[key][1] == "task=reasoning_gym":
        extras.require("reasoning_gym", extras.RGYM)
    valid = set(VALID[key][0].split()) if key in VALID else set()
    for kind, value in bad_values(KEYS[key][0]).items():
        error = start_up(key, value)
        if kind in valid:
            assert error is None, f"{key}={value!r} is valid ({VALID[key][1]}) but was refused: {error}"
            continue
        assert error is not None, f"{key}={value!r} was accepted at start-up: refuse it, or list it in VALID"
        message = str(error)
        if isinstance(error, OmegaConfBaseException):  # Hydra's merge: a wrong type, or not an enum's value
            assert f"full_key: {key}" in message, message
            assert kind == "type" or "expected one of [" in message, message
        else:
            assert f"{key}" in message and shown(value) in message, message
        assert "Traceback" not in message


@pytest.mark.parametrize("key, value, more, message", [
    ("model.tiny.num_experts", 1, None, r"^model.tiny.num_experts=1: expected 0 \(a dense model\) or at"),
    ("model.tiny.num_heads", 3, None, r"^model.tiny.num_heads=3: expected heads of an even width"),
    ("model.tiny.hidden_size", 36, None,
     r"^model.tiny.num_heads=4: expected heads of an even width .* model.tiny.hidden_size=36"),
    ("model.tiny.num_kv_heads", 3, None, r"^model.tiny.num_kv_heads=3: expected a divisor of model"),
    ("model.tiny.intermediate_size", 10**9, None, r"make a model of 3.8e\+11 parameters: expected at most"),
    ("model.tiny.warmup_target_accuracy", 1.5, None, r"^model.tiny.warmup_target_accuracy=1.5: expected an"),
    ("model.tiny.shared_expert_intermediate_size", 8, None,
     r"^model.tiny.shared_expert_intermediate_size=8: a dense model .* has no shared expert"),
    ("train.lora.target_modules", [], None, r"^train.lora.target_modules=\[\]: expected one or more"),
    ("task.answer_format", "(", None, r"^task.answer_format='\(': not a regular expression"),
    ("parallel.world_size", 2, None, r"^parallel.world_size=2: it is derived, tp x pp x cp x dp = 1"),
    ("parallel.etp", 2, None, r"^parallel=single: parallel.etp=2 is not supported by train=torch"),
    ("algo.mis_high", 0.5, None, r"^algo.mis_high=0.5: expected a ratio > 1$"),
    ("task.reward_retries", -2, None, r"^task.reward_retries=-2: expected a number of retries >= 0$"),
    ("rollout.rollout_num_gpus", 3, "rollout.rollout_num_gpus_per_engine=2",
     r"^rollout.rollout_num_gpus=3: expected a multiple of rollout.rollout_num_gpus_per_engine=2$"),
])
def test_the_one_constraint_that_failed_is_named(key, value, more, message, start_up):
    """The cases issue 46 found, and values between zero and huge: each message names the key,
    its value and the one constraint it breaks (not every constraint of its group)."""
    error = start_up(key, value, *([more] if more else []))
    assert isinstance(error, ConfigError) and re.search(message, str(error)), error


def test_train_num_threads_0_is_refused_before_torch_sees_it(tmp_path, caplog):
    """torch.set_num_threads(0) was the first thing a job ran: a RuntimeError traceback, even for a
    rollout-only run, whose trainer checks never ran. Now the job (what the CLI runs) exits 2
    with the key's one line, and the process keeps its threads."""
    import torch

    from relax.loop import run_job

    threads = torch.get_num_threads()
    cfg = make_cfg("debug=rollout_only", "train.num_threads=0", run_dir=tmp_path)
    with pytest.raises(SystemExit) as stop:
        run_job(cfg)
    assert stop.value.code == 2
    assert "train.num_threads=0: expected a positive integer" in caplog.text
    assert torch.get_num_threads() == threads
