"""`relax bugreport`: one archive of a run (config, versions, machine, source revision, doctor,
the first rollout's replay data, logs, MANIFEST), no secrets, clear errors; and the archive
alone replays the run's first rollout."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from relax.cli import main as relax_main
from relax.tools import system_info

from .conftest import REPO, only_run_dir, relax_cli, run_loop

RUN = ["rollout.num_rollout=2", "rollout.rollout_batch_size=4", "checkpoint.save_interval=null"]
SECRET = "wandb-key-3f9c2e7a51d04b8e"  # long and random-looking: no chance match in gzip bytes
PRIVATE = "private-note-8d1e6b0c2a"  # in a variable whose name looks harmless
SHOWN = "shown-value-17"


def bugreport(*args: str) -> tuple[int, str, str]:
    """`relax bugreport ...` through relax.cli.main, in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        relax_main(["bugreport", *map(str, args)])
    return exit_.value.code, out.getvalue(), err.getvalue()


def members(archive: Path) -> dict[str, bytes]:
    """The archive's files, by path below its one folder."""
    with tarfile.open(archive) as tar:
        tops = {m.name.split("/")[0] for m in tar.getmembers()}
        assert len(tops) == 1, tops
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_path) -> Path:
    """A real two-rollout debug=dump run, with secrets in its environment."""
    root = tmp_path_factory.mktemp("bugreport")
    proc = relax_cli(*RUN, "debug=dump", f"hydra.run.dir={root}/run", cwd=root,
                     env={"WANDB_API_KEY": SECRET, "RELAX_NOTE": PRIVATE})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "run"


@pytest.fixture(scope="module")
def archive(run) -> Path:
    out = run.parent / "report" / "bug.tar.gz"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_API_KEY", SECRET)
        mp.setenv("RELAX_NOTE", PRIVATE)
        mp.setenv("RELAX_BUGREPORT_SHOWN", SHOWN)
        code, stdout, stderr = bugreport(run, "-o", out, "--env", "RELAX_BUGREPORT_SHOWN",
                                         "--env", "NOT_SET_X")
    assert code == 0, stderr
    assert stdout.startswith(f"wrote {out} (")
    assert "relax bugreport: running relax doctor" in stderr and "relax bugreport: writing" in stderr
    return out


LAYERS = {"layers/0_train.pt", "layers/0_engine.pt", "layers/0_ref.pt"}  # debug=dump's layer dump


def test_the_archive_holds_the_run_and_a_manifest_of_it(run, archive):
    files = members(archive)
    assert set(files) == LAYERS | {
        ".hydra/config.yaml", ".hydra/overrides.yaml", "config.yaml", "built.json", "status.json",
        "metrics.jsonl", "samples.jsonl", "relax.log", "first_step_log_probs.pt", "doctor.md",
        "rollout_data/0.pt", "train_data/0_0.pt", "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json", "tokenizer/chat_template.jinja",
        "doctor.txt", "system.json", "environment.json", "MANIFEST.json"}
    for name in (".hydra/overrides.yaml", "metrics.jsonl", "rollout_data/0.pt", "train_data/0_0.pt",
                 *LAYERS):
        assert files[name] == (run / name).read_bytes(), name
    manifest = json.loads(files["MANIFEST.json"])
    listed = {e["path"]: e for e in manifest["files"]}
    assert set(listed) == set(files) - {"MANIFEST.json"}
    for name, data in files.items():
        if name != "MANIFEST.json":
            entry = listed[name]
            assert (entry["size"], entry["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
    assert manifest["not_found"] == []
    assert manifest["doctor"] == {"command": f"relax doctor {run}", "exit_code": 0}
    assert "[PASS] 1. responses at the first rollout" in files["doctor.txt"].decode()
    assert [p.name for p in archive.parent.iterdir()] == ["bug.tar.gz"]  # the temp file was renamed


def test_versions_machine_and_source_revision(archive):
    system = json.loads(members(archive)["system.json"])
    versions = system["versions"]
    assert list(versions) == ["python", *system_info.PACKAGES]
    assert versions["python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}.")
    for name in system_info.PACKAGES:
        try:
            assert versions[name] == importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            assert versions[name] == "not installed"
    assert versions["torch"] == torch.__version__
    m = system["machine"]
    assert m["cpu_count"] == os.cpu_count() and m["cpu"] and m["platform"]
    assert m["memory"]["MemTotal"].endswith("GiB")
    if not torch.cuda.is_available() and not shutil.which("nvidia-smi"):
        assert m["gpu"]["gpus"] == "none"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    head = head.strip()
    source = system["relax_source"]
    assert source["revision"] == head and source["source"] == str(REPO)
    # the tracked files changed since HEAD, as git names them (a checkout being edited: CI's is clean)
    changed = subprocess.run(["git", "diff", "--name-only", "--no-renames", "HEAD"], cwd=REPO,
                             capture_output=True, text=True).stdout.split()
    assert (source["dirty"], source["changed_files"]) == (bool(changed), changed[:100])
    outside = system_info.source_revision(Path("/"))  # not Relax's checkout
    assert outside["revision"] == "unknown" and outside["dirty"] == "unknown"


def test_versions_import_neither_sglang_nor_megatron():
    code = ("import sys; from relax.tools.bugreport import versions; versions(); "
            "print([m for m in sys.modules if m.split('.')[0] in ('sglang', 'megatron', 'torch')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_versions_name_the_interpreter_and_a_missing_package(monkeypatch):
    monkeypatch.setattr(system_info, "PACKAGES", ("relax-no-such-package-x", "torch"))
    versions = system_info.versions()
    assert versions == {"python": f"{platform.python_version()} ({platform.python_implementation()}, "
                                  f"{sys.executable})",
                        "relax-no-such-package-x": "not installed",
                        "torch": importlib.metadata.version("torch")}


def test_a_commands_output_keeps_its_leading_spaces_and_a_failure_is_none(tmp_path):
    assert system_info._run(["sh", "-c", "printf ' M a.py\\n M b.py\\n\\n'"]) == " M a.py\n M b.py"
    assert system_info._run(["sh", "-c", "echo partial; exit 3"]) is None
    assert system_info._run(["relax-no-such-command-x"]) is None
    assert system_info._run(["pwd"], cwd=tmp_path) == str(tmp_path)


def test_memory_cpus_and_cpu_model_as_the_machine_reports_them(monkeypatch):
    """/proc/meminfo's kB in GiB (total and available); the CPUs this process may run on, not
    all of them; the cpuinfo `model name` line (not the `model` number line before it)."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    memory = system_info._meminfo()
    assert sorted(memory) == ["MemAvailable", "MemTotal"]
    assert memory["MemTotal"] == f"{int(info['MemTotal'].split()[0]) / 2**20:.1f} GiB"
    gib = {k: float(v.removesuffix(" GiB")) for k, v in memory.items()}
    assert 0 < gib["MemAvailable"] <= gib["MemTotal"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    m = system_info.machine()
    assert (m["cpus_usable"], m["cpu_count"]) == (1, os.cpu_count())
    assert m["memory"]["MemTotal"] == memory["MemTotal"]
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")]
    if names:
        assert m["cpu"] == names[0]


def test_gpus_from_torch_and_nvidia_smi(monkeypatch):
    """Every CUDA device by name; nvidia-smi's lines (or that it failed); "gpus": "none" only when
    neither sees a GPU."""
    cuda = torch.version.cuda or "none (CPU build)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"GPU{i}")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert system_info._gpu() == {"torch_cuda": cuda, "devices": ["GPU0", "GPU1"]}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert system_info._gpu() == {"torch_cuda": cuda, "gpus": "none"}
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    smi = "H200, 570.1, 143771 MiB"
    monkeypatch.setattr(system_info, "_run", lambda args, cwd=None: f"{smi}\n{smi}")
    assert system_info._gpu() == {"torch_cuda": cuda, "nvidia_smi": [smi, smi]}
    monkeypatch.setattr(system_info, "_run", lambda args, cwd=None: None)
    assert system_info._gpu() == {"torch_cuda": cuda, "nvidia_smi": "nvidia-smi failed"}


def test_source_revision_of_a_checkout_by_hand(tmp_path, monkeypatch):
    """A git checkout's HEAD; its changed tracked files by name (the first 100; untracked files
    are not changes); a folder inside a checkout, or git status failing, is not a known state."""
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                       capture_output=True)
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    for i in range(120):
        (repo / "sub" / f"f{i:03d}.py").write_text("x\n")
    (repo / "a.py").write_text("x\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "x")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout
    head = head.strip()
    (repo / "new.py").write_text("untracked\n")
    assert system_info.source_revision(repo) == {"source": str(repo), "revision": head, "dirty": False,
                                                 "changed_files": []}
    (repo / "a.py").write_text("changed\n")
    assert system_info.source_revision(repo)["changed_files"] == ["a.py"]
    for i in range(120):
        (repo / "sub" / f"f{i:03d}.py").write_text("changed\n")
    revision = system_info.source_revision(repo)
    assert revision["dirty"] is True and revision["revision"] == head
    assert revision["changed_files"] == ["a.py"] + [f"sub/f{i:03d}.py" for i in range(99)]
    assert system_info.source_revision(repo / "sub") == {"source": str(repo / "sub"), "revision": "unknown",
                                                         "dirty": "unknown"}
    run = system_info._run
    monkeypatch.setattr(system_info, "_run",
                        lambda args, cwd=None: None if "status" in args else run(args, cwd))
    assert system_info.source_revision(repo) == {"source": str(repo), "revision": head, "dirty": "unknown"}


def test_no_secret_reaches_the_archive(run, archive, tmp_path, monkeypatch):
    raw = archive.read_bytes()
    for data in (raw, gzip.decompress(raw)):
        assert SECRET.encode() not in data and PRIVATE.encode() not in data
    files = members(archive)
    assert json.loads(files["environment.json"]) == {"RELAX_BUGREPORT_SHOWN": SHOWN, "NOT_SET_X": None}
    manifest = json.loads(files["MANIFEST.json"])
    assert manifest["environment_variables"] == ["RELAX_BUGREPORT_SHOWN", "NOT_SET_X"]
    # a secret that reached a run's file (a config value read from ${oc.env:...}) is redacted
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    with open(copy / "relax.log", "a") as f:
        f.write(f"logger: api_key={SECRET}\n")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    code, _, err = bugreport(copy, "-o", tmp_path / "b.tar.gz")
    assert code == 0, err
    raw = (tmp_path / "b.tar.gz").read_bytes()
    assert SECRET.encode() not in gzip.decompress(raw)
    files = members(tmp_path / "b.tar.gz")
    assert "api_key=<redacted $WANDB_API_KEY>" in files["relax.log"].decode()
    assert "environment.json" not in files
    redacted = json.loads(files["MANIFEST.json"])["redacted"]
    assert redacted == [{"path": "relax.log", "variable": "WANDB_API_KEY"}]


def test_a_failing_doctor_does_not_stop_the_report(run, tmp_path, monkeypatch):
    def broken(argv):
        raise RuntimeError("doctor exploded")

    monkeypatch.setattr("relax.tools.doctor.main", broken)
    code, out, err = bugreport(run, "-o", tmp_path)  # a dir: the default name inside it
    assert code == 0, err
    archive = tmp_path / f"bugreport-{run.name}.tar.gz"
    assert f"wrote {archive}" in out and "relax doctor failed on the run" in out
    files = members(archive)
    manifest = json.loads(files["MANIFEST.json"])
    assert manifest["doctor"]["error"] == "RuntimeError: doctor exploded"
    assert "RuntimeError: doctor exploded" in files["doctor.txt"].decode() and "rollout_data/0.pt" in files


def test_a_run_without_hydra_saved_elsewhere_and_with_layers(tmp_path, tiny_path):
    """An in-process run (no .hydra/), its rollouts saved by a template outside the run dir, a
    layer dump in it: the lowest rollout id is taken from the template, layers/ whole."""
    run_dir = tmp_path / "run"
    run_loop(run_dir, "debug=rollout_only", "rollout.num_rollout=2", "rollout.rollout_batch_size=4",
             "checkpoint.save_interval=null", f"debug.save_rollout_data={tmp_path}/saved/r_{{rollout_id}}.pt")
    (run_dir / "layers").mkdir()
    (run_dir / "layers" / "0_train.pt").write_bytes(b"layer tensors")
    code, out, err = bugreport(run_dir)
    assert code == 0, err
    archive = run_dir / "bugreport-run.tar.gz"  # the default name
    files = members(archive)
    assert files["rollout_data/0.pt"] == (tmp_path / "saved" / "r_0.pt").read_bytes()
    assert "rollout_data/1.pt" not in files and files["layers/0_train.pt"] == b"layer tensors"
    manifest = json.loads(files["MANIFEST.json"])
    assert [m["part"] for m in manifest["not_found"]] == [".hydra/config.yaml", ".hydra/overrides.yaml",
                                                          "status.json", "relax.log"]
    assert manifest["replay"]["command"] == (
        "relax debug=train_only 'debug.load_rollout_data=bugreport-run/rollout_data/{rollout_id}.pt' "
        "rollout.num_rollout=1")


def test_a_crashed_resumed_run_keeps_every_config_log_and_the_layer_dump_it_names(tmp_path, monkeypatch):
    """A run dir written by hand, as a crashed multi-process run resumed in its own dir leaves one:
    every .hydra/restart_<n> config and every process's log are taken, the layer dump built.json
    names outside the run (not a link in it), one non-finite dump of several; a password's value is
    redacted wherever it occurs (logs, JSONL), a secret-looking variable named with --env is not; the doctor's
    own refusal is recorded; a config value only Hydra resolves is no path looked at."""
    run, layers = tmp_path / "run", tmp_path / "elsewhere" / "layers"
    for folder in (run / ".hydra" / "restart_1", run / "nonfinite", layers):
        folder.mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("debug: {dump_details: '${hydra:runtime.output_dir}/d'}\n")
    (run / ".hydra" / "restart_1" / "config.yaml").write_text("resume: true\n")
    (run / "status.json").write_text(json.dumps({"status": "failed", "error": "boom"}))
    (run / "built.json").write_text(json.dumps({"dump_layers": str(layers)}))
    monkeypatch.setenv("DB_PASSWORD", "hunter2-hunter2")
    monkeypatch.setenv("RELAX_SHOWN_TOKEN", "shown-token-42")
    for name in ("relax.log", "rank1.log", "engine0.log"):
        (run / name).write_text(f"{name}: hunter2-hunter2, hunter2-hunter2, shown-token-42\n")
    (run / "samples.jsonl").write_text('{"response": "hunter2-hunter2"}\n')
    for name in ("0_mb0.pt", "0_mb1.pt"):
        (run / "nonfinite" / name).write_bytes(b"groups")
    (layers / "0_train.pt").write_bytes(b"layer tensors")
    (tmp_path / "outside.txt").write_text("a file elsewhere on the machine")
    (layers / "link.pt").symlink_to(tmp_path / "outside.txt")
    code, _, err = bugreport(run, "--env", "RELAX_SHOWN_TOKEN")
    assert code == 0, err
    files = members(run / "bugreport-run.tar.gz")
    assert set(files) == {".hydra/config.yaml", ".hydra/restart_1/config.yaml", "status.json", "built.json",
                          "samples.jsonl", "relax.log", "rank1.log", "engine0.log", "nonfinite/0_mb0.pt",
                          "layers/0_train.pt", "doctor.txt", "system.json", "environment.json",
                          "MANIFEST.json"}
    assert files["rank1.log"] == (b"rank1.log: <redacted $DB_PASSWORD>, <redacted $DB_PASSWORD>, "
                                  b"shown-token-42\n")
    assert files["samples.jsonl"] == b'{"response": "<redacted $DB_PASSWORD>"}\n'
    manifest = json.loads(files["MANIFEST.json"])
    assert manifest["replay"] is None
    parts = [m["part"] for m in manifest["not_found"]]
    assert parts == [".hydra/overrides.yaml", "metrics.jsonl", "rollout_data"]
    assert manifest["not_found"][-1]["why"] == ("no replay data: the run saved none (debug=dump or "
                                                "debug.save_rollout_data saves it); looked at "
                                                f"{run}/rollout_data/{{rollout_id}}.pt")
    doctor, report = manifest["doctor"], files["doctor.txt"].decode()
    refusal = f"relax doctor: error: {run}/samples.jsonl: a record without an integer rollout_id"
    assert (doctor["exit_code"], doctor["error"], report.strip().splitlines()[-1]) == (2, refusal, refusal)


def test_bad_inputs_exit_2_with_one_clear_line(run, tmp_path):
    multirun = tmp_path / "multi"
    shutil.copytree(run / ".hydra", multirun / "parallel=tp2" / ".hydra")
    (tmp_path / "plain").mkdir()
    (tmp_path / "file").write_text("x")
    cases = [
        ([tmp_path / "nope"], f"{tmp_path / 'nope'}: no such directory"),
        ([tmp_path / "file"], f"{tmp_path / 'file'} is a file, not a run dir"),
        ([tmp_path / "plain"], f"{tmp_path / 'plain'} is not a run dir (no .hydra/, status.json or "
                               "metrics.jsonl in it): expected the folder a run wrote, "
                               "outputs/runs/<date>_<time>"),
        ([multirun], f"{multirun} is a multirun dir: pass one of its jobs, e.g. {multirun / 'parallel=tp2'}"),
        ([run, "-o", tmp_path / "file" / "b.tar.gz"],
         f"cannot write {tmp_path / 'file' / 'b.tar.gz'}: {tmp_path / 'file'} is a file, not a directory"),
    ]
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        cases.append(([run, "-o", tmp_path / "ro" / "b.tar.gz"],
                      f"cannot write {tmp_path / 'ro' / 'b.tar.gz'}: permission denied in {tmp_path / 'ro'}"))
    for args, message in cases:
        code, out, err = bugreport(*args)
        assert (code, out, err) == (2, "", f"relax bugreport: error: {message}\n"), args
    def disk_full(path, mode="wb"):
        raise OSError(28, "No space left on device")

    with pytest.MonkeyPatch.context() as mp:  # a failure while writing: the same one line
        mp.setattr("relax.files.atomic_open", disk_full)
        code, out, err = bugreport(run, "-o", tmp_path / "b.tar.gz")
    assert code == 2 and "Traceback" not in err  # after the progress lines:
    full = f"relax bugreport: error: writing {tmp_path / 'b.tar.gz'}: No space left on device"
    assert err.splitlines()[-1] == full
    proc = relax_cli("bugreport", str(tmp_path / "nope"), cwd=tmp_path)  # the real CLI
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr == f"relax bugreport: error: {tmp_path / 'nope'}: no such directory\n"
    assert not list(tmp_path.rglob("*.tar.gz")) and not list(tmp_path.rglob(".*.tmp"))


def test_the_archive_alone_replays_the_first_rollout(run, archive, tmp_path):
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path, filter="data")
    manifest = json.loads((tmp_path / f"bugreport-{run.name}" / "MANIFEST.json").read_text())
    command = manifest["replay"]["command"]
    assert command == ("relax rollout.rollout_batch_size=4 debug=train_only 'debug.load_rollout_data="
                       f"bugreport-{run.name}/rollout_data/{{rollout_id}}.pt' rollout.num_rollout=1")
    proc = relax_cli(*shlex.split(command)[1:], cwd=tmp_path)  # where the archive was extracted
    assert proc.returncode == 0, proc.stderr[-3000:]
    replay, original = ([json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
                        for d in (only_run_dir(tmp_path), run))
    steps = [r for r in replay if "step" in r]
    assert len(steps) == 1 and "train/loss" in steps[0]
    first = next(r for r in original if "step" in r)
    assert steps[0]["train/grad_norm"] == first["train/grad_norm"]  # the same step, bit for bit
