"""The debugging guide's workflows: rollout-only, train-only replay, detail dumps, inspect."""

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax.debug.plan import Plan, check_dumps, resolve
from relax.errors import ConfigError, ReplayError
from relax.files import atomic_save, safe_load
from relax.replay import discover_rollout_ids, load_rollout, save_rollout, subsample_groups
from relax.sample import Sample

from .conftest import REPO, make_cfg, only_run_dir, run_loop, status_of

SHORT = ["rollout.num_rollout=3", "rollout.rollout_batch_size=8", "checkpoint.save_interval=null"]


@pytest.fixture(scope="module")
def dumped(tmp_path_factory, tiny_path):
    """A full 3-rollout run with every detail dumped."""
    root = tmp_path_factory.mktemp("dumped")
    rollouts, steps = run_loop(root / "run", *SHORT, f"debug.dump_details={root / 'dump'}")
    return root / "dump", rollouts, steps


def guide(command: str, cwd, extra: str = "") -> subprocess.CompletedProcess:
    """Run a command line from the guide as written, from a repo-root-like directory."""
    if not (cwd / "relax").exists():
        (cwd / "relax").symlink_to(REPO / "relax")
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    return subprocess.run(f"{command} {extra}", shell=True, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def built(run_dir):
    return json.loads((run_dir / "built.json").read_text())


def rollout_records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step" not in r]


# -- the guide's five command lines ------------------------------------------------------

def test_guide_rollout_only_with_gpu_flags_exactly_as_written(tmp_path, tiny_path):
    proc = guide("python3 relax/entrypoints/train.py --debug-rollout-only --rollout-num-gpus 8 "
                 "--rollout-num-gpus-per-engine 8", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run_dir(tmp_path)
    assert built(run)["mode"] == "rollout_only" and built(run)["trainer"] is None
    config = (run / ".hydra" / "config.yaml").read_text()
    assert "rollout_num_gpus: 8" in config and "rollout_num_gpus_per_engine: 8" in config
    records = rollout_records(run)
    assert len(records) == 400 and "rollout/log_probs" not in records[0]


def test_guide_save_then_load_then_train_only_then_dump(tmp_path, tiny_path):
    x = tmp_path / "x"
    short = "rollout.num_rollout=3 rollout.rollout_batch_size=8"
    proc = guide(f"python3 relax/entrypoints/train.py --debug-rollout-only "
                 f"--save-debug-rollout-data {x}/data_{{rollout_id}}.pt", tmp_path, short)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in x.iterdir()) == ["data_0.pt", "data_1.pt", "data_2.pt"]

    for i, command in enumerate([
        f"python3 relax/entrypoints/train.py --load-debug-rollout-data {x}/data_{{rollout_id}}.pt",
        f"python3 relax/entrypoints/train.py --debug-train-only --load-debug-rollout-data "
        f"{x}/data_{{rollout_id}}.pt",
    ]):
        proc = guide(command, tmp_path, f"{short} hydra.run.dir=outputs/replay{i}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        run = tmp_path / "outputs" / f"replay{i}"
        assert built(run)["mode"] == "train_only" and built(run)["rollout_engine"] is None
        assert [r["rollout_id"] for r in rollout_records(run)] == [0, 1, 2]

    proc = guide(f"python3 relax/entrypoints/train.py --dump-details {x}/dump", tmp_path,
                 "rollout.num_rollout=2 rollout.rollout_batch_size=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    dump = x / "dump"
    assert sorted(p.name for p in (dump / "rollout_data").iterdir()) == ["0.pt", "1.pt"]
    assert sorted(p.name for p in (dump / "train_data").iterdir()) == ["0_0.pt", "1_0.pt"]
    assert (dump / "tokenizer" / "tokenizer.json").is_file() and (dump / "config.yaml").is_file()


def test_guide_flags_mix_with_hydra_overrides_and_bad_flags_list_known_ones(tmp_path):
    proc = guide("python3 relax/entrypoints/train.py --debug-rollout-only --cfg job", tmp_path,
                 "rollout.temperature=0.5")
    assert proc.returncode == 0 and "rollout_only: true" in proc.stdout
    assert "temperature: 0.5" in proc.stdout
    proc = guide("python3 relax/entrypoints/train.py --debug-rolout-only", tmp_path)
    assert proc.returncode != 0 and "--debug-rollout-only" in proc.stderr


# -- which subsystems get built ------------------------------------------------------------

def test_rollout_only_never_constructs_a_trainer(tmp_path, monkeypatch, tiny_path):
    def boom(*a, **k):
        raise AssertionError("trainer constructed in rollout_only")

    monkeypatch.setattr("relax.train.make_trainer", boom)
    rollouts, steps = run_loop(tmp_path, *SHORT, "debug=rollout_only")
    assert len(rollouts) == 3 and steps == []
    assert built(tmp_path)["trainer"] is None
    assert built(tmp_path)["rollout_engine"] == "relax.rollout.torch_engine.TorchEngine"


def test_train_only_never_constructs_an_engine(tmp_path, monkeypatch, dumped):
    dump, _, _ = dumped

    def boom(*a, **k):
        raise AssertionError("engine constructed in train_only")

    monkeypatch.setattr("relax.rollout.torch_engine.TorchEngine.__init__", boom)
    rollouts, steps = run_loop(tmp_path, *SHORT, "debug=train_only",
                               f"debug.load_rollout_data={dump}/rollout_data/{{rollout_id}}.pt")
    assert len(rollouts) == 3 and len(steps) == 3
    assert built(tmp_path)["rollout_engine"] is None


@pytest.mark.parametrize("mode,absent", [
    ("debug=rollout_only", "relax.train.torch_trainer"),
    ("debug=train_only", "relax.rollout.torch_engine"),
])
def test_the_skipped_backend_is_never_imported(tmp_path, dumped, mode, absent):
    dump, _, _ = dumped
    args = [*SHORT, mode, f"debug.load_rollout_data={dump}/rollout_data/{{rollout_id}}.pt"] \
        if mode == "debug=train_only" else [*SHORT, mode]
    code = (f"import sys\nfrom relax.cli import main\nmain({args!r})\n"
            f"print('IMPORTED' if {absent!r} in sys.modules else 'NOT_IMPORTED')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("NOT_IMPORTED")


# -- conflicts: errors before anything is built ---------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (["debug.rollout_only=true", "debug.train_only=true"], "conflicts with debug.train_only"),
    (["debug.rollout_only=true", "debug.load_rollout_data=/x/{rollout_id}.pt"],
     "conflicts with debug.load_rollout_data"),
    (["debug.train_only=true"], "needs debug.load_rollout_data"),
    (["debug.save_rollout_data=/x/data.pt"], "has no {rollout_id}"),
    (["debug.save_train_data=/x/train.pt"], "has no {rollout_id}"),
    (["rollout.num_rollout=1", "debug.save_train_data=/x/t_{rollout_id}.pt", "parallel.dp=2",
      "parallel.fsdp=true"], "has no {rank}"),
    (["debug.rollout_only=true", "debug.save_train_data=/x/{rollout_id}_{rank}.pt"],
     "builds no trainer"),
    (["rollout.rollout_num_gpus=8", "rollout.rollout_num_gpus_per_engine=3"],
     "rollout.rollout_num_gpus=8: expected a multiple of rollout.rollout_num_gpus_per_engine=3"),
    (["parallel.pp=2"], "use train=megatron"),
])
def test_conflicting_debug_keys_fail_at_start_up(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        resolve(make_cfg(*overrides))


def test_save_and_load_of_the_same_files_is_refused(dumped):
    dump, _, _ = dumped
    template = f"{dump}/rollout_data/{{rollout_id}}.pt"
    with pytest.raises(ConfigError, match="overwrite its own input"):
        resolve(make_cfg(f"debug.load_rollout_data={template}", f"debug.save_rollout_data={template}"))


def test_load_template_without_matches_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no files match"):
        resolve(make_cfg(f"debug.load_rollout_data={tmp_path}/{{rollout_id}}.pt"))


def test_load_rollout_data_turns_on_train_only(dumped):
    dump, _, _ = dumped
    plan = resolve(make_cfg(f"debug.load_rollout_data={dump}/rollout_data/{{rollout_id}}.pt"))
    assert plan.mode == "train_only" and not plan.builds_rollout and plan.rollout_ids == [0, 1, 2]


def test_a_replay_uses_its_files_from_the_start_rollout_to_num_rollout_without_a_hole(tmp_path):
    """The replayed rollout ids: those of start_rollout_id..num_rollout-1 that have a file, with
    no hole from the start (a resumed replay's too); a hole is refused naming where to stop."""
    def replay(*ids):
        folder = tmp_path / "-".join(map(str, ids))
        for i in ids:
            (folder / f"{i}.pt").parent.mkdir(exist_ok=True)
            (folder / f"{i}.pt").write_bytes(b"")  # found by name: read later, with the run's manifest
        return f"debug.load_rollout_data={folder}/{{rollout_id}}.pt"

    cfg = make_cfg(replay(0, 1, 2, 3, 4), "rollout.num_rollout=3", "debug.load_rollout_data_subsample=1")
    assert resolve(cfg).rollout_ids == [0, 1, 2] and resolve(cfg, start_rollout_id=1).rollout_ids == [1, 2]
    with pytest.raises(ConfigError, match=r"no file for rollout id\(s\) \[2\] between 0 and 4; restore them, "
                                          r"or set rollout.num_rollout=2 to stop before the gap"):
        resolve(make_cfg(replay(0, 1, 3, 4), "rollout.num_rollout=5"))
    with pytest.raises(ConfigError, match=r"no file for rollout id\(s\) \[2\] between 2 and 4"):
        resolve(make_cfg(replay(0, 3, 4), "rollout.num_rollout=5"), start_rollout_id=2)


def test_dump_and_profile_rollouts_and_samples_resolve_or_are_refused(tmp_path, monkeypatch):
    """debug.dump_layers_rollouts (default: the run's first, a resumed run's first too, sorted and
    distinct), debug.profile_rollouts (default: the second), sample indices below
    the samples per rollout and distinct; `~` in a template is the home dir; a save template
    without {rollout_id} for two rollouts is refused."""
    monkeypatch.setenv("HOME", str(tmp_path))
    small = ["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
             f"debug.dump_layers={tmp_path}/l"]
    cfg = make_cfg(*small, "rollout.num_rollout=3", "debug.save_rollout_data=~/s/{rollout_id}.pt",
                   "debug.profile_dir='~/p'")
    plan = resolve(cfg)
    assert (plan.dump_layers_rollouts, plan.profile_rollouts) == ([0], [1])
    assert (plan.save_rollout_data, plan.profile_dir) == (f"{tmp_path}/s/{{rollout_id}}.pt", f"{tmp_path}/p")
    assert plan.built(cfg.rollout, cfg.train, cfg.parallel)["dump_layers"] == f"{tmp_path}/l"  # built.json: where bugreport looks
    assert resolve(cfg, start_rollout_id=2).dump_layers_rollouts == [2]  # a resumed run's first
    plan = resolve(make_cfg(*small, "rollout.num_rollout=3", "debug.dump_layers_rollouts=[2,0,2]"))
    assert plan.dump_layers_rollouts == [0, 2]
    for override, message in [
            ("debug.dump_layers_samples=[0,4]", r"\[4\] beyond the 4 samples per rollout"),
            ("debug.dump_layers_samples=[1,1]", "expected distinct sample indices"),
            ("debug.save_rollout_data=/x/data.pt", r"has no \{rollout_id\} but 2 rollouts")]:
        with pytest.raises(ConfigError, match=message):
            resolve(make_cfg(*small, "rollout.num_rollout=2", override))


def test_a_dump_holding_another_runs_files_is_refused_unless_resumed_from_it(tmp_path):
    """Any part of a dump (layers/ too), or any file of a layer dump, marks it taken; only the run
    that wrote it (its built.json names it) continues into it."""
    dump, layers, run = tmp_path / "dump", tmp_path / "layers", tmp_path / "run"
    (dump / "layers").mkdir(parents=True)
    layers.mkdir()
    (layers / "0_train.pt").write_bytes(b"")
    run.mkdir()
    check_dumps(Plan(True, True, [0], dump_dir=tmp_path / "new", dump_layers=str(tmp_path / "layers2")), None)
    for plan, key, found in ((Plan(True, True, [0], dump_dir=dump), "dump_dir", "layers"),
                             (Plan(True, True, [0], dump_layers=str(layers)), "dump_layers", "0_train.pt")):
        with pytest.raises(ConfigError, match=rf"already holds a dump \({found}\)"):
            check_dumps(plan, None)
        (run / "built.json").write_text(json.dumps({key: str(tmp_path / "other")}))
        with pytest.raises(ConfigError, match="already holds a dump"):
            check_dumps(plan, run)  # a resumed run whose dump was another
        (run / "built.json").write_text(json.dumps({key: str(getattr(plan, key))}))
        check_dumps(plan, run)


# -- replay data ------------------------------------------------------------------------------

def test_replay_reproduces_the_original_run_exactly(tmp_path, dumped):
    dump, rollouts, steps = dumped
    replay_rollouts, replay_steps = run_loop(
        tmp_path, *SHORT, f"debug.load_rollout_data={dump}/rollout_data/{{rollout_id}}.pt")
    for a, b in zip(steps, replay_steps, strict=True):
        assert a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
    for a, b in zip(rollouts, replay_rollouts, strict=True):  # (the dump ran the reference every rollout)
        for key in ("rollout/log_probs", "rollout/raw_reward"):
            assert a[key] == b[key], key
    assert replay_rollouts[0]["rollout/ref_log_probs"] == rollouts[0]["rollout/ref_log_probs"]


def test_rollout_file_contents(dumped, tokenizer):
    dump, _, _ = dumped
    data = safe_load(dump / "rollout_data" / "1.pt")
    assert data["format_version"] == 3 and data["rollout_id"] == 1
    m = data["manifest"]
    assert m["tokenizer"]["vocab_size"] == len(tokenizer.get_vocab())
    assert m["sampling"]["temperature"] == 1.0 and m["sampling"]["n_samples_per_prompt"] == 8
    assert {"model_path", "model_fingerprint", "config_hash", "relax_version"} <= m.keys()
    s = data["samples"][0]
    assert {"prompt", "tokens", "response", "response_length", "loss_mask", "reward", "label",
            "rollout_log_probs", "status", "metadata"} <= s.keys()
    assert len(s["rollout_log_probs"]) == s["response_length"] == len(s["loss_mask"])
    assert s["token_versions"] == [1] * s["response_length"]  # rollout 1: sampled by the policy trained on 0
    assert tokenizer.decode(s["tokens"][-s["response_length"]:], skip_special_tokens=True) == s["response"]


def test_train_data_contents(dumped):
    dump, _, steps = dumped
    data = safe_load(dump / "train_data" / "0_0.pt")
    assert data["rollout_id"] == 0 and data["dp_rank"] == 0
    assert len(data["samples"]) == 64
    row = data["samples"][5]
    for key in ("tokens", "loss_mask", "reward", "advantage", "log_probs", "ref_log_probs",
                "rollout_log_probs", "kl", "entropy"):
        assert key in row, key
    assert row["log_probs"] == row["ref_log_probs"]  # rollout 0: actor == reference
    assert data["steps"] == [{"loss": steps[0]["train/loss"], "grad_norm": steps[0]["train/grad_norm"]}]


def _copy_with(tiny_path, dst, edit):
    shutil.copytree(tiny_path, dst)
    edit(dst)
    return dst


def test_manifest_mismatch_is_refused_with_what_differs(tmp_path, dumped, tiny_path):
    dump, _, _ = dumped

    def swap_tokens(d):
        tj = json.loads((d / "tokenizer.json").read_text())
        vocab = tj["model"]["vocab"]
        vocab["7"], vocab["8"] = vocab["8"], vocab["7"]
        (d / "tokenizer.json").write_text(json.dumps(tj))

    def wider_rope(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["rope_parameters"] = {**cfg.get("rope_parameters", {}), "rope_theta": 500000.0}
        cfg["rope_theta"] = 500000.0
        (d / "config.json").write_text(json.dumps(cfg))

    template = f"{dump}/rollout_data/{{rollout_id}}.pt"
    for edit, message in [(swap_tokens, "tokenizer vocabulary differs"),
                          (wider_rope, "model architecture")]:
        other = _copy_with(tiny_path, tmp_path / edit.__name__, edit)
        with pytest.raises(ReplayError, match=message):
            run_loop(tmp_path / f"run_{edit.__name__}", *SHORT, "model=hf", f"model.path={other}",
                     f"debug.load_rollout_data={template}")
    with pytest.raises(ReplayError, match="rollout.temperature"):
        run_loop(tmp_path / "run_temp", *SHORT, "rollout.temperature=0.7",
                 f"debug.load_rollout_data={template}")
    # the explicit override replays it anyway
    rollouts, _ = run_loop(tmp_path / "run_allowed", *SHORT, "rollout.temperature=0.7",
                           "debug.allow_manifest_mismatch=true", f"debug.load_rollout_data={template}")
    assert len(rollouts) == 3


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_pickle_that_runs_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    torch.save({"format_version": 1, "rollout_id": 0, "samples": [_RunsCode()]}, path)
    with pytest.raises(ReplayError, match="evil.pt: refused"):
        load_rollout(path)
    assert not (tmp_path / "PWNED").exists()


def test_truncated_or_corrupt_file_names_the_file(tmp_path, dumped):
    dump, _, _ = dumped
    good = (dump / "rollout_data" / "0.pt").read_bytes()
    (tmp_path / "half.pt").write_bytes(good[:len(good) // 2])
    with pytest.raises(ReplayError, match="half.pt: corrupt or truncated"):
        load_rollout(tmp_path / "half.pt")
    (tmp_path / "other.pt").write_bytes(b"not a torch file")
    with pytest.raises(ReplayError, match="other.pt: corrupt or truncated"):
        load_rollout(tmp_path / "other.pt")


def test_atomic_save_leaves_no_half_file(tmp_path, monkeypatch):
    def crash(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"a": 1}, tmp_path / "out.pt")
    assert list(tmp_path.iterdir()) == []



def test_atomic_open_writes_a_hidden_file_beside_the_target_syncs_it_then_renames(tmp_path, monkeypatch):
    """Readers see the old file until the new one is whole and on disk: it is written to a
    hidden .tmp in the target's directory (a rename across filesystems would be a copy),
    fsynced, and only then renamed onto the target."""
    from relax import files

    target = tmp_path / "state.json"
    target.write_text("old")
    synced, real_fsync = [], os.fsync

    def fsync(fd):
        synced.append((Path(os.readlink(f"/proc/self/fd/{fd}")).name, target.read_text()))
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    with files.atomic_open(target, "w") as f:
        f.write("new")
        (tmp,) = [p for p in tmp_path.iterdir() if p != target]
        assert tmp.name.startswith(".state.json.") and tmp.name.endswith(".tmp")
        assert target.read_text() == "old"
    assert synced == [(tmp.name, "old")]
    assert target.read_text() == "new" and list(tmp_path.iterdir()) == [target]


def test_read_jsonl_drops_only_a_torn_last_line_and_names_any_other_bad_line(tmp_path):
    from relax.files import read_jsonl

    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3, "b"')  # a crash mid-append tears the last line
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
    path.write_text('{"a": 1}\n{"a": 2, "b"\n{"a": 3}\n')
    with pytest.raises(ReplayError, match=r"m.jsonl: line 2 is not JSON"):
        read_jsonl(path)
    path.write_text('{"a": 1}\n[2]\n')
    with pytest.raises(ReplayError, match=r"m.jsonl: line 2 is not a JSON object"):
        read_jsonl(path)


def test_sha256_reads_the_whole_file_and_fill_expands_rollout_and_rank_zero(tmp_path):
    import hashlib

    from relax.files import fill, sha256

    data = bytes(range(256)) * (3 * 4096 + 1)  # 3 MiB and a bit: several read blocks
    (tmp_path / "w.bin").write_bytes(data)
    assert sha256(tmp_path / "w.bin") == hashlib.sha256(data).hexdigest()
    assert fill("~/d/{rollout_id}_{rank}.pt", rollout_id=0, rank=0) == Path.home() / "d" / "0_0.pt"
    assert fill("d/{rollout_id}_{rank}.pt", rollout_id=3) == Path("d/3_{rank}.pt").absolute()


def test_subsample_keeps_whole_groups(dumped):
    dump, _, _ = dumped
    _, samples = load_rollout(dump / "rollout_data" / "0.pt")
    kept = subsample_groups(samples, 0.25, seed=0)
    assert len(kept) == 16  # 2 of 8 groups, 8 samples each
    assert [s.index for s in kept] == list(range(16))
    assert [s.group_index for s in kept] == [0] * 8 + [1] * 8
    assert len({s.metadata["replay_index"] // 8 for s in kept[:8]}) == 1


def _rollout(groups: int, size: int) -> list[Sample]:
    """A small rollout: `groups` GRPO groups of `size`, every sample's tokens its own."""
    return [Sample(i, i // size, "", [1 + i // size, 100 + i], 1, reward=float(i % size), loss_mask=[1],
                   rollout_log_probs=[-0.5]) for i in range(groups * size)]


def test_subsample_rounds_up_reseeds_per_rollout_and_keeps_the_original_index(tmp_path):
    full = _rollout(10, 2)
    picked = []
    for rollout_id in range(4):
        save_rollout(tmp_path / f"{rollout_id}.pt", rollout_id, full, {})
        saved_id, kept = load_rollout(tmp_path / f"{rollout_id}.pt", subsample=0.25, seed=3)
        assert saved_id == rollout_id
        assert len(kept) == 6  # ceil(0.25 x 10) = 3 whole groups of 2
        assert [s.index for s in kept] == list(range(6))
        assert [s.group_index for s in kept] == [0, 0, 1, 1, 2, 2]
        for s in kept:  # each one is the full rollout's sample metadata["replay_index"] names
            assert s.tokens == full[s.metadata["replay_index"]].tokens
        picked.append(tuple(s.metadata["replay_index"] for s in kept))
    assert len(set(picked)) > 1  # each rollout's own seed (seed + rollout id): not the same groups every time
    kept = subsample_groups(full, 0.5, seed=0)
    # copies: the input is left as it was
    assert [(s.index, s.group_index) for s in full] == [(i, i // 2) for i in range(20)]
    assert all("replay_index" not in s.metadata for s in full)
    assert len(kept) == 10


@pytest.mark.parametrize("edit, message", [
    ({"response_length": 2, "loss_mask": [1, 1], "rollout_log_probs": [-0.5, -0.5]}, "response_length 2"),
    ({"rollout_log_probs": [-0.5, -0.5]}, "2 rollout_log_probs"),
    ({"loss_mask": []}, "0 loss_mask"),
    ({"reward": "1.0"}, "the reward a number"),
    ({"tokens": [1, 2.0]}, "must be integers"),
    ({"routed_experts": [3, 4, 5]}, "routed_experts"),  # 3 tokens feed 2: not [2, layers, top_k]
    ({"routed_experts": []}, "routed_experts"),
])
def test_a_malformed_saved_sample_is_refused(edit, message):
    good = _rollout(1, 1)[0].to_dict()
    assert Sample.from_dict({**good, "routed_experts": [3, 4, 5]}).routed_experts == [3, 4, 5]
    assert Sample.from_dict({k: v for k, v in good.items() if k != "routed_experts"}) == _rollout(1, 1)[0]
    with pytest.raises(ValueError, match=message):
        Sample.from_dict({**good, **edit, **({"tokens": [1, 2, 3]} if "routed_experts" in edit else {})})


def test_a_rollout_must_come_in_equal_contiguous_groups_numbered_in_order():
    from relax.sample import group_size_of

    assert group_size_of(_rollout(3, 2)) == 2
    for groups, indices in [([0, 1, 0, 1], range(4)), ([0, 0, 0, 1], range(4)), ([0, 0, 1, 1], [0, 1, 3, 2])]:
        rollout = _rollout(2, 2)
        for s, g, i in zip(rollout, groups, indices, strict=True):
            s.group_index, s.index = g, i
        with pytest.raises(ValueError, match="GRPO groups|0..N-1"):
            group_size_of(rollout)


def test_a_manifest_that_is_no_mapping_is_refused_even_without_a_check(tmp_path):
    save_rollout(tmp_path / "0.pt", 0, _rollout(1, 2), ["not", "a", "mapping"])
    for manifest, allow in ((None, False), ({"model_fingerprint": "x"}, True)):
        with pytest.raises(ReplayError, match="0.pt: malformed rollout data: the manifest is not a mapping"):
            load_rollout(tmp_path / "0.pt", manifest, allow)


def test_discover_finds_rollout_ids_of_any_number_of_digits(tmp_path):
    for rollout_id in (0, 7, 10, 123):
        save_rollout(tmp_path / f"rollout_{rollout_id}.pt", rollout_id, _rollout(1, 2), {})
    (tmp_path / "rollout_x.pt").write_bytes(b"")
    found = discover_rollout_ids(f"{tmp_path}/rollout_{{rollout_id}}.pt")
    assert found == {i: tmp_path / f"rollout_{i}.pt" for i in (0, 7, 10, 123)}
    assert list(found) == [0, 7, 10, 123]


def test_subsampled_replay_trains(tmp_path, dumped):
    dump, _, _ = dumped
    rollouts, steps = run_loop(tmp_path, *SHORT, "debug.load_rollout_data_subsample=0.5",
                               f"debug.load_rollout_data={dump}/rollout_data/{{rollout_id}}.pt",
                               f"debug.save_train_data={tmp_path}/t_{{rollout_id}}_{{rank}}.pt")
    assert len(steps) == 3
    assert [len(safe_load(tmp_path / f"t_{i}_0.pt")["samples"]) for i in range(3)] == [32] * 3


def test_debug_dump_defaults_to_the_run_dir(tmp_path, tiny_path):
    from .conftest import relax_cli

    proc = relax_cli("debug=dump", "rollout.num_rollout=2", "rollout.rollout_batch_size=4",
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run_dir(tmp_path)
    assert status_of(run)["status"] == "completed"
    assert (run / "rollout_data" / "1.pt").is_file() and (run / "train_data" / "1_0.pt").is_file()
    assert (run / "tokenizer" / "tokenizer.json").is_file() and (run / "config.yaml").is_file()
    assert built(run)["dump_dir"] == str(run)


# -- relax inspect ------------------------------------------------------------------------------

def test_inspect_terminal_and_json(dumped):
    dump, rollouts, _ = dumped
    run = lambda *a: subprocess.run([sys.executable, "-m", "relax", "inspect", str(dump), *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    proc = run("--json", "--rollout", "1", "--sample", "3")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [r["rollout_id"] for r in report["rollouts"]] == [0, 1, 2]
    assert report["rollouts"][1]["mean_reward"] == pytest.approx(rollouts[1]["rollout/raw_reward"])
    sample = report["sample"]
    assert sample["rollout_id"] == 1 and sample["index"] == 3
    assert sample["train"]["dp_rank"] == 0 and len(sample["train"]["log_probs"]) == sample["response_length"]
    join = report["train_join"]
    assert join["trained_samples"] == 64 and join["untrained_samples"] == []
    assert max(r["max_abs_diff_vs_rollout"] for r in join["per_sample"]) < 1e-4

    text = run("--rollout", "1", "--sample", "3")
    assert text.returncode == 0
    for needle in ("Rollouts", "mean reward", "Rollout 1, sample 3", "rollout_log_prob",
                   "ref_log_prob", "trained by dp rank 0"):
        assert needle in text.stdout, needle
    missing = run("--rollout", "9")
    assert missing.returncode == 2 and "no rollout 9" in missing.stderr


def test_inspect_summarizes_and_joins_by_hand(tmp_path):
    """inspect() on hand-written files: rollout ids of any digits, per-rollout numbers over the
    model's tokens only (a tool's token, loss_mask 0, is counted as masked), the trained samples
    joined by index with their largest |Δ|, the untrained listed, and the rendered token table
    giving each trained token its own train log-prob."""
    from rich.console import Console

    from relax.tools.inspect import inspect, render

    tool = Sample(0, 0, "p", [5, 6, 7, 8, 9], 3, reward=1.0, loss_mask=[1, 0, 1],
                  rollout_log_probs=[-1.0, -9.0, -3.0], status="truncated")
    aborted = Sample(1, 0, "p", [5, 6, 7], 1, reward=0.0, loss_mask=[1], rollout_log_probs=[-2.0],
                     status="aborted")
    save_rollout(tmp_path / "rollout_data" / "0.pt", 0, [tool, aborted], {})
    save_rollout(tmp_path / "rollout_data" / "10.pt", 10, _rollout(1, 2), {})
    row = {"index": 0, "reward": 1.0, "advantage": 0.7, "log_probs": [-1.0, -3.5],
           "ref_log_probs": [-1.0, -3.0], "rollout_log_probs": [-1.0, -3.0]}
    atomic_save({"rank": 0, "dp_rank": 0, "samples": [row]}, tmp_path / "train_data" / "0_0.pt")
    report = inspect(tmp_path, None, 0, worst=0)
    assert [r["rollout_id"] for r in report["rollouts"]] == [0, 10]
    assert report["rollouts"][0] == {
        "rollout_id": 0, "samples": 2, "mean_reward": 0.5, "mean_response_len": 2.0, "max_response_len": 3,
        "truncation_rate": 0.5, "mean_rollout_log_prob": -2.0, "masked_tokens": 1}
    join = report["train_join"]
    assert report["sample"]["rollout_id"] == 0 and report["sample"]["train"]["advantage"] == 0.7
    assert (join["trained_samples"], join["untrained_samples"], join["ranks"]) == (1, [1], [0])
    assert join["per_sample"][0]["max_abs_diff_vs_rollout"] == 0.5  # the last token's, not the first's
    out = io.StringIO()
    render(report, Console(file=out, width=200))
    assert "-3.500000" in out.getvalue()  # the third response token: the second trained one
    with pytest.raises(ReplayError, match=r"no rollout 5 \(have 0\.\.10\)"):
        inspect(tmp_path, 5, 0, worst=0)
    with pytest.raises(ReplayError, match="rollout 0 has samples 0..1"):
        inspect(tmp_path, 0, -1, worst=0)
    row["log_probs"] = [-1.0, -3.5, -4.0]  # 3 trained tokens for a sample with 2
    atomic_save({"rank": 0, "dp_rank": 0, "samples": [{**row, "ref_log_probs": [0.0] * 3,
                                                       "rollout_log_probs": [0.0] * 3}]},
                tmp_path / "train_data" / "0_0.pt")
    with pytest.raises(ReplayError, match="sample 0 has 3 per-token log_probs, but the rollout file"):
        inspect(tmp_path, 0, 0, worst=0)
