"""The reliability campaign's cases (docs/reliability.md): bad inputs of every kind, across
config, data, rewards, model files, replay files, checkpoints, the tools, and disk.

A case names the bad input, how to make it (overrides, and files written under the case's
tmp dir from `Env`, what every case starts from), and the error message it must end in.
tests/test_campaign.py runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


@dataclass
class Env:
    """What the cases start from, built once: the tiny model, a finished run, replay files."""
    model: Path
    done: Path      # a finished 2-rollout run: metrics, checkpoints, .hydra/config.yaml, status
    replay: Path    # rollout files 0.pt, 1.pt, 2.pt of a 4-sample rollout each


@dataclass
class Case:
    id: str
    what: str             # the bad input, in words
    make: object          # overrides (a dict), or make(tmp, env) -> overrides, writing files under tmp
    expect: str           # regex the error message must match
    kind: str = "run"     # run: start-up | rollout: a rollout | doctor, compare, inspect: the tool
    loses: bool = False   # accepting it silently loses or mixes data
    code: int = 2         # the exit code: 2 for a refusal (docs/reliability.md), a tool's own for a report


# -- ways to make bad inputs -------------------------------------------------------------------

def jsonl(*lines: str | bytes):
    def make(tmp: Path, env: Env) -> dict:
        data = tmp / "data.jsonl"
        data.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
        return {"task": "jsonl", "task.data_path": str(data)}
    return make


def model_dir(mutate: Callable[[Path], object]):
    def make(tmp: Path, env: Env) -> dict:
        shutil.copytree(env.model, tmp / "model")
        mutate(tmp / "model")
        return {"model": "hf", "model.path": str(tmp / "model")}
    return make


def replay(mutate: Callable[[Path], object], **overrides):
    def make(tmp: Path, env: Env) -> dict:
        shutil.copytree(env.replay, tmp / "replay", ignore=shutil.ignore_patterns("run"))
        mutate(tmp / "replay")
        return {"rollout.num_rollout": "3", "debug.load_rollout_data": f"{tmp}/replay/{{rollout_id}}.pt",
                **overrides}
    return make


def done_run(mutate: Callable[[Path], object] = lambda run: None, **overrides):
    """A copy of the finished run, changed by `mutate`; `<done>` in overrides is its path."""
    def make(tmp: Path, env: Env) -> dict:
        shutil.copytree(env.done, tmp / "done")
        mutate(tmp / "done")
        return {k: str(v).replace("<done>", str(tmp / "done")) for k, v in overrides.items()}
    return make


CKPT = "checkpoints/rollout_000001"


def checkpoint(mutate: Callable[[Path], object]):
    """resume=<that checkpoint> of a copy of the finished run, changed by `mutate`."""
    return done_run(lambda run: mutate(run / CKPT), resume=f"<done>/{CKPT}")


def write(name: str, data: str | bytes) -> Callable[[Path], object]:
    def mutate(folder: Path):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        return (folder / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return mutate


def truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def garble(path: Path) -> None:
    """Garbage of the same size (a size check cannot see it)."""
    path.write_bytes(b"x" * path.stat().st_size)


def edit_json(path: Path, change: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def edit_rollout(name: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        data = torch.load(folder / name, weights_only=True)
        change(data)
        torch.save(data, folder / name)
    return mutate


PWNED = Path("/tmp/relax_campaign_pwned")  # what a hostile file would create if it ran


class Payload:
    """A pickle that would run a command when loaded without weights_only."""

    def __reduce__(self):
        return os.system, (f"touch {PWNED}",)


def hostile(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"samples": Payload()}, path)


LIVE: list[subprocess.Popen] = []  # stand-ins for live runs, stopped when the cases are done


def running(path: Path, alive: bool) -> None:
    """status.json `running`, written by a process that is alive (a sleep) or has exited."""
    proc = subprocess.Popen(["sleep", "300"] if alive else ["true"])
    ticks = int(Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[19]) if alive else 0
    (LIVE.append if alive else lambda p: p.wait())(proc)
    path.write_text(json.dumps({"status": "running", "pid": proc.pid, "host": socket.gethostname(),
                                "pid_start": ticks}))


def stop_live() -> None:
    for proc in LIVE:
        proc.kill()
        proc.wait()


# Rewards that break the contract reward(response, label) -> float.
def reward_str(response, label):
    return "yes"


def reward_none(response, label):
    return None


def reward_list(response, label):
    return [1.0]


def reward(name: str) -> dict:
    return {"task.reward_fn": f"tests.campaign.reward_{name}"}


TAG = "a: !!python/object/apply:os.system ['touch /tmp/relax_campaign_pwned']\n"

CASES = [
    # config
    Case("temperature", "rollout.temperature=-1", {"rollout.temperature": "-1"},
         r"rollout.temperature=-1.0: expected a number >= 0"),
    Case("num_rollout", "rollout.num_rollout=0", {"rollout.num_rollout": "0"},
         r"rollout.num_rollout=0: expected a positive integer"),
    Case("batch_size", "rollout.rollout_batch_size=0", {"rollout.rollout_batch_size": "0"},
         r"rollout.rollout_batch_size=0: expected a positive integer"),
    Case("n_samples", "rollout.n_samples_per_prompt=0", {"rollout.n_samples_per_prompt": "0"},
         r"rollout.n_samples_per_prompt=0: expected a positive integer"),
    Case("max_new_tokens", "rollout.max_new_tokens=0", {"rollout.max_new_tokens": "0"},
         r"rollout.max_new_tokens=0"),
    Case("top_p", "rollout.top_p=1.5", {"rollout.top_p": "1.5"},
         r"rollout.top_p=1.5: expected a probability"),
    Case("micro_batch", "train.micro_batch_size=0", {"train.micro_batch_size": "0"},
         r"train.micro_batch_size=0: expected a positive integer"),
    Case("num_steps", "train.num_steps_per_rollout=0", {"train.num_steps_per_rollout": "0"},
         r"train.num_steps_per_rollout=0: expected a positive integer"),
    Case("lr", "train.lr=-1", {"train.lr": "-1"}, r"train.lr=-1.0: expected a finite number >= 0"),
    Case("batch_split", "3 samples per rollout, train.num_steps_per_rollout=2",
         {"rollout.rollout_batch_size": "3", "rollout.n_samples_per_prompt": "1",
          "train.num_steps_per_rollout": "2"},
         r"3 samples per rollout, which do not split into train.num_steps_per_rollout=2 x parallel.dp=1"),
    Case("tp_heads", "parallel.tp=3 (the model has 4 heads, 2 KV heads)", {"parallel.tp": "3"},
         r"tp=3 must divide the model's num_attention_heads=4, num_key_value_heads=2"),
    Case("keep_last", "checkpoint.keep_last=-1",
         {"checkpoint.keep_last": "-1", "checkpoint.save_interval": "1"},
         r"checkpoint.keep_last=-1: expected at least 1", loses=True),
    Case("save_interval", "checkpoint.save_interval=0", {"checkpoint.save_interval": "0"},
         r"checkpoint.save_interval=0: expected a positive number"),
    Case("positions", "rollout.max_new_tokens=200 (the model has 128 positions)",
         {"rollout.max_new_tokens": "200"},
         r"rollout.max_new_tokens=200 leaves no room for a prompt within the model's max_position_embedd"),
    Case("save_into_file", "debug.save_rollout_data under a regular file",
         lambda tmp, env: write("f", "x")(tmp) and {"debug.save_rollout_data": f"{tmp}/f/{{rollout_id}}.pt"},
         r"debug.save_rollout_data=.*/f is a file, not a directory"),
    Case("dump_exists", "--dump-details into an existing dump",
         lambda tmp, env: write("dump/rollout_data/0.pt", "")(tmp) or {"debug.dump_details": f"{tmp}/dump"},
         r"already holds a dump \(rollout_data\)", loses=True),
    Case("run_dir_taken", "a new run into a run dir that holds a run", done_run(),
         r"already holds a run \(metrics.jsonl and checkpoints\)", kind="run_in_done", loses=True),
    # data
    Case("no_label", "JSONL record without 'label'", jsonl('{"prompt": "1+1="}'),
         r"data.jsonl:1: no 'label'"),
    Case("null_prompt", "JSONL record with a null prompt", jsonl('{"prompt": null, "label": "2"}'),
         r"data.jsonl:1: 'prompt' must be a non-empty string, found None"),
    Case("number_prompt", "JSONL prompt that is a number", jsonl('{"prompt": 12, "label": "2"}'),
         r"'prompt' must be a non-empty string, found 12"),
    Case("empty_prompt", "JSONL prompt that is empty", jsonl('{"prompt": "", "label": "2"}'),
         r"'prompt' must be a non-empty string, found ''"),
    Case("null_label", "JSONL label that is null", jsonl('{"prompt": "1+1=", "label": null}'),
         r"'label' must be a string or a number, found None"),
    Case("list_record", "JSONL line that is a list", jsonl('["1+1=", "2"]'),
         r"data.jsonl:1: expected a JSON object"),
    Case("not_utf8", "non-UTF-8 JSONL",
         jsonl('{"prompt": "1+1=", "label": "2"}', b'{"prompt": "\xff", "label": "2"}'),
         r"data.jsonl:2: not UTF-8 text"),
    Case("bad_json", "JSONL line that is not JSON", jsonl('{"prompt": "1+1=", "label": '),
         r"data.jsonl:1: not a JSON line"),
    Case("long_prompt", "a 100k-character prompt", jsonl(json.dumps({"prompt": "1+" * 50_000, "label": "2"})),
         r"data.jsonl:1: the prompt has \d+ tokens, more than the \d+"),
    Case("empty_data", "an empty JSONL file", jsonl(), r"the dataset is empty"),
    # rewards: only a rollout can show what a reward returns
    Case("reward_str", "a reward returning a string", reward("str"), r"returned 'yes' \(a str\) for sample 0",
         kind="rollout"),
    Case("reward_none", "a reward returning None", reward("none"), r"returned None \(a NoneType\)",
         kind="rollout"),
    Case("reward_list", "a reward returning a list", reward("list"), r"returned \[1.0\] \(a list\)",
         kind="rollout"),
    Case("reward_import", "task.reward_fn that does not import", {"task.reward_fn": "no.such.reward"},
         r"task.reward_fn='no.such.reward' does not import"),
    # model files
    Case("weights_truncated", "truncated model.safetensors",
         model_dir(lambda m: truncate(m / "model.safetensors", 5000)),
         r"model.safetensors: corrupt or truncated safetensors file"),
    Case("weights_garbage", "garbage model.safetensors", model_dir(lambda m: garble(m / "model.safetensors")),
         r"model.safetensors: corrupt or truncated safetensors file"),
    Case("config_truncated", "truncated config.json", model_dir(lambda m: truncate(m / "config.json", 40)),
         r"config.json: not valid JSON"),
    Case("config_keys", "config.json without num_attention_heads",
         model_dir(lambda m: edit_json(m / "config.json", lambda c: c.pop("num_attention_heads"))),
         r"config.json: no integer num_attention_heads"),
    Case("no_tokenizer", "model dir without tokenizer files",
         model_dir(lambda m: [f.unlink() for f in m.glob("tokenizer*")]), r"cannot load its tokenizer"),
    Case("no_weights", "model dir without *.safetensors",
         model_dir(lambda m: (m / "model.safetensors").unlink()),
         r"no \*.safetensors weights"),
    Case("model_missing", "model.path that does not exist",
         {"model": "hf", "model.path": "/nonexistent/model"},
         r"model.path='/nonexistent/model': no config.json"),
    # replay files: every one checked before the first rollout
    Case("replay_gap", "replay dir missing rollout 1 of 0..2", replay(lambda d: (d / "1.pt").unlink()),
         r"no file for rollout id\(s\) \[1\] between 0 and 2"),
    Case("replay_corrupt", "the last replay file truncated", replay(lambda d: truncate(d / "2.pt")),
         r"2.pt: corrupt or truncated file"),
    Case("replay_hostile", "a replay file holding a code-running pickle",
         replay(lambda d: hostile(d / "2.pt")),
         r"2.pt: refused: it holds objects other than plain data"),
    Case("replay_manifest", "a replay file sampled at another temperature",
         replay(edit_rollout("2.pt", lambda d: d["manifest"]["sampling"].update(temperature=0.3))),
         r"2.pt: rollout data does not match this run"),
    Case("replay_id", "a replay file holding another rollout than its name says",
         replay(lambda d: shutil.copy(d / "0.pt", d / "2.pt")),
         r"2.pt: holds rollout 0, but its name says rollout 2"),
    Case("replay_sample", "a replay sample whose tokens are text",
         replay(edit_rollout("1.pt", lambda d: d["samples"][0].update(tokens="abc"))),
         r"1.pt: malformed rollout data"),
    Case("replay_groups", "a replay with broken GRPO groups",
         replay(edit_rollout("1.pt", lambda d: d["samples"][0].update(group_index=1))),
         r"1.pt: malformed rollout data: samples must come in equal, contiguous GRPO groups"),
    Case("replay_split", "4 replayed samples, train.num_steps_per_rollout=3",
         replay(lambda d: None, **{"train.num_steps_per_rollout": "3"}),
         r"0.pt gives 4 samples per rollout, which do not split"),
    Case("replay_empty", "a replay file with no samples",
         replay(edit_rollout("0.pt", lambda d: d.update(samples=[]))),
         r"0.pt: no samples"),
    Case("subsample", "debug.load_rollout_data_subsample=0",
         replay(lambda d: None, **{"debug.load_rollout_data_subsample": "0"}),
         r"debug.load_rollout_data_subsample=0.0: expected a fraction"),
    # checkpoints and resume
    Case("resume_none", "resume=true with no checkpoint", {"resume": "true"},
         r"resume=true but no complete checkpoint"),
    Case("state_garbage", "resume=<checkpoint> whose relax_state.json is garbage",
         checkpoint(write("relax_state.json", "{garbage")),
         r"incomplete checkpoint \(relax_state.json unreadable"),
    Case("state_shape", "resume=<checkpoint> whose relax_state.json is a list",
         checkpoint(write("relax_state.json", "[]")),
         r"incomplete checkpoint .*no rollout_id, ref_model_path"),
    Case("ref_model_gone", "resume a checkpoint whose reference model is gone",
         checkpoint(lambda c: edit_json(c / "relax_state.json", lambda s: s.update(ref_model_path="/gone"))),
         r"needs its run's reference model .* /gone, which is unusable"),
    Case("ckpt_weights", "resume a checkpoint whose weights are garbage of the right size",
         checkpoint(lambda c: garble(c / "hf" / "model.safetensors")),
         r"needs its weights .*corrupt or truncated safetensors"),
    Case("resume_live", "resume a run that is still running",
         done_run(lambda r: running(r / "status.json", alive=True), resume="<done>"),
         r"is a run that is still running \(pid \d+ on .*, alive\)"),
    # the tools on garbage and hostile files
    Case("doctor_metrics", "relax doctor: metrics.jsonl garbage",
         done_run(write("metrics.jsonl", "garbage\n{}\n")),
         r"metrics.jsonl: line 1 is not JSON", kind="doctor"),
    Case("doctor_record", "relax doctor: a metrics line that is a list",
         done_run(write("metrics.jsonl", "[1]\n[2]\n")),
         r"metrics.jsonl: line 1 is not a JSON object", kind="doctor"),
    Case("doctor_config", "relax doctor: .hydra/config.yaml garbage",
         done_run(write(".hydra/config.yaml", "a: [unclosed\n")), r"config.yaml: not a Relax config",
         kind="doctor"),
    Case("doctor_yaml_tag", "relax doctor: config.yaml with a python object tag",
         done_run(write(".hydra/config.yaml", TAG)), r"config.yaml: not a Relax config", kind="doctor"),
    Case("doctor_train_data", "relax doctor: hostile train data",
         done_run(lambda r: hostile(r / "train_data/0_0.pt")),
         r"0_0.pt: refused: it holds objects other than plain data", kind="doctor"),
    Case("doctor_samples", "relax doctor: non-UTF-8 samples.jsonl",
         done_run(write("samples.jsonl", b"\xff\xfe\n")),
         r"samples.jsonl: not UTF-8 text", kind="doctor"),
    Case("doctor_dead", "relax doctor on a run killed with SIGKILL (status running)",
         done_run(lambda r: running(r / "status.json", alive=False)), r"run: died: status.json says running",
         kind="doctor", code=0),  # a report, not a refusal: the finished rollouts' checks all pass
    Case("compare_hostile", "relax compare: hostile first_step_log_probs.pt",
         done_run(lambda r: hostile(r / "first_step_log_probs.pt")),
         r"refused: it holds objects other than plain data", kind="compare"),
    Case("compare_truncated", "relax compare: truncated first_step_log_probs.pt",
         done_run(lambda r: truncate(r / "first_step_log_probs.pt")),
         r"first_step_log_probs.pt: corrupt or truncated", kind="compare"),
    Case("compare_config", "relax compare: .hydra/config.yaml a list",
         done_run(write(".hydra/config.yaml", "- 1\n")),
         r"config.yaml: not a Relax config", kind="compare"),
    Case("compare_dead", "relax compare on a run killed with SIGKILL",
         done_run(lambda r: running(r / "status.json", alive=False)), r"died: status.json says running",
         kind="compare", code=1),  # verdict FAILED: compare's exit 1
    Case("inspect_sample", "relax inspect: a rollout file whose samples lack fields",
         replay(edit_rollout("0.pt", lambda d: d["samples"][0].pop("tokens"))),
         r"0.pt: malformed rollout data: .*tokens", kind="inspect"),
    Case("inspect_dead", "relax inspect on a run killed with SIGKILL (status running)",
         replay(lambda d: running(d / "status.json", alive=False)), r"run: died: status.json says running",
         kind="inspect", code=0),  # a report of the run's rollouts
    # disk
    Case("disk_full", "disk full while writing a checkpoint", {"checkpoint.save_interval": "1"},
         r"disk full while writing checkpoint .*rollout_000000", kind="disk_full"),
]
