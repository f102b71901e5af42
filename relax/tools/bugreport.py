"""`relax bugreport <run dir>`: one archive of a run to attach to an issue.

Writes <run dir>/bugreport-<run name>.tar.gz (or -o FILE), atomically, with one folder
bugreport-<run name>/ in it that is laid out like the run dir, so `relax doctor` and
`relax inspect` read it once extracted:

How it works in detail: docs/debugging.md, "Inside `relax/tools/bugreport.py`".
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import shlex
import sys
import tarfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

import relax
from relax.errors import ReplayError
from relax.tools.system_info import environment, machine, source_revision, versions

PROG = "relax bugreport"
# What a run dir holds that a maintainer can read (checkpoints are left out: weights, GBs).
RUN_FILES = (".hydra/config.yaml", ".hydra/overrides.yaml", "config.yaml", "built.json", "status.json",
             "metrics.jsonl", "samples.jsonl", "weight_check.json", "first_step_log_probs.pt", "doctor.md")
EXPECTED = (".hydra/config.yaml", ".hydra/overrides.yaml", "status.json", "metrics.jsonl",
            "samples.jsonl")  # reported as not found when absent (the others are optional)
TEXT_SUFFIXES = {".yaml", ".json", ".jsonl", ".log", ".txt", ".md", ".jinja"}  # scanned for secrets
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE", re.I)
# Overrides a replay of the first rollout must not repeat: it sets its own debug mode and
# length, writes its own dir, and needs no resume, checkpoints or remote loggers.
NOT_REPLAYED = {"debug", "hydra", "resume", "checkpoint", "logger"}


class BugReportError(Exception):
    """Bad input: one line on stderr, exit 2."""


@dataclass
class Contents:
    top: str  # the archive's one folder
    files: dict[str, Path] = field(default_factory=dict)  # arcname (below top) -> file on disk
    generated: dict[str, bytes] = field(default_factory=dict)  # arcname -> bytes written here
    missing: list[dict] = field(default_factory=list)  # {"part", "why"}

    def add(self, arcname: str, path: Path) -> None:
        if path.is_file():
            self.files.setdefault(arcname, path)

    def not_found(self, part: str, why: str) -> None:
        self.missing.append({"part": part, "why": why})


# -- the run ------------------------------------------------------------------------------------

def is_run_dir(path: Path) -> bool:
    return any((path / name).exists() for name in (".hydra", "status.json", "metrics.jsonl"))


def check_run_dir(path: Path) -> None:
    if not path.exists():
        raise BugReportError(f"{path}: no such directory")
    if not path.is_dir():
        raise BugReportError(f"{path} is a file, not a run dir")
    if is_run_dir(path):
        return
    jobs = sorted(p.name for p in path.iterdir() if p.is_dir() and is_run_dir(p))
    if jobs:
        raise BugReportError(f"{path} is a multirun dir: pass one of its jobs, e.g. {path / jobs[0]}")
    raise BugReportError(f"{path} is not a run dir (no .hydra/, status.json or metrics.jsonl in it): "
                         f"expected the folder a run wrote, outputs/runs/<date>_<time>")


def _yaml(path: Path) -> dict:
    try:
        data = OmegaConf.to_container(OmegaConf.load(path))
    except Exception:
        return {}
    return data if isinstance(data, dict) else {}


def run_settings(run_dir: Path) -> dict[str, str]:
    """Where the run put its dumps: built.json's absolute paths, else the config's values (the
    dump's resolved config.yaml, then .hydra's, skipping interpolations only Hydra resolves)."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError):
        built = json.loads((run_dir / "built.json").read_text())
        if isinstance(built, dict):
            out.update({k: v for k in ("dump_dir", "save_rollout_data", "replay_from", "dump_layers")
                        if isinstance(v := built.get(k), str)})
    for config in (run_dir / "config.yaml", run_dir / ".hydra" / "config.yaml"):
        debug = _yaml(config).get("debug") if config.is_file() else None
        for built_key, key in (("dump_dir", "dump_details"), ("save_rollout_data", "save_rollout_data"),
                               ("replay_from", "load_rollout_data"), ("dump_layers", "dump_layers")):
            value = debug.get(key) if isinstance(debug, dict) else None
            if isinstance(value, str) and "${" not in value:
                out.setdefault(built_key, value)
    return out


def lowest_file(template: str) -> tuple[int, Path] | None:
    from relax.replay import discover_rollout_ids  # (imports torch: versions are read without it)

    found = discover_rollout_ids(template)
    return next(iter(found.items())) if found else None


def add_tree(contents: Contents, arcdir: str, folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():  # a link could point anywhere on the machine
            contents.add(f"{arcdir}/{path.relative_to(folder).as_posix()}", path)


def collect_run(run_dir: Path, contents: Contents) -> int | None:
    """The run's files into `contents`; returns the first rollout's id (None: no replay data)."""
    for name in RUN_FILES:
        contents.add(name, run_dir / name)
    for name in EXPECTED:
        if name not in contents.files:
            contents.not_found(name, f"not in {run_dir}")
    for restart in sorted((run_dir / ".hydra").glob("restart_*")):  # a resume into the same dir
        for name in ("config.yaml", "overrides.yaml"):
            contents.add(f".hydra/{restart.name}/{name}", restart / name)
    logs = sorted(run_dir.glob("*.log"))  # relax.log, and rank<i>.log / engine<i>.log of other processes
    for path in logs:
        contents.add(path.name, path)
    if not logs:
        contents.not_found("relax.log", f"no *.log in {run_dir}")

    settings = run_settings(run_dir)
    dumps = [run_dir] + ([Path(settings["dump_dir"])] if "dump_dir" in settings else [])
    templates = [f"{d}/rollout_data/{{rollout_id}}.pt" for d in dumps]
    templates += [settings[k] for k in ("save_rollout_data", "replay_from") if k in settings]
    first = None
    for template in templates:  # the run's own dump first, the data it replayed last
        try:
            first = lowest_file(template)
        except ReplayError as e:  # a template naming one unreadable file
            contents.not_found("rollout_data", str(e))
        if first:
            break
    if first:
        rollout_id, path = first
        contents.add(f"rollout_data/{rollout_id}.pt", path)
    else:
        contents.not_found("rollout_data", "no replay data: the run saved none (debug=dump or "
                           "debug.save_rollout_data saves it); looked at " + ", ".join(templates))
    dump = next((d for d in dumps if (d / "rollout_data").is_dir() or (d / "tokenizer").is_dir()), None)
    if dump and first:
        for path in sorted((dump / "train_data").glob(f"{first[0]}_*.pt")):
            contents.add(f"train_data/{path.name}", path)
    if dump and (dump / "tokenizer").is_dir():
        add_tree(contents, "tokenizer", dump / "tokenizer")
    layers = [Path(settings["dump_layers"])] if "dump_layers" in settings else []
    layer_dir = next((d for d in layers + [d / "layers" for d in dumps] if d.is_dir()), None)
    if layer_dir:
        add_tree(contents, "layers", layer_dir)
    else:
        contents.not_found("layers/", "no layer dump (debug.dump_layers)")
    nonfinite = sorted((run_dir / "nonfinite").glob("*.pt"))
    if nonfinite:  # the groups of a micro-batch whose loss or gradient was NaN/Inf
        contents.add(f"nonfinite/{nonfinite[0].name}", nonfinite[0])
    return first[0] if first else None


def run_doctor(run_dir: Path) -> tuple[bytes, dict]:
    """`relax doctor <run dir>`, in this process, its output captured; whatever goes wrong in it
    is recorded, not raised (a bug report is wanted most when a run is broken)."""
    from relax.tools import doctor  # (imports torch: versions are read without it)

    out = io.StringIO()
    info: dict = {"command": f"relax doctor {run_dir}"}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            info["exit_code"] = doctor.main([str(run_dir)])
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # SystemExit from argparse too
        info["error"] = f"{type(e).__name__}: {e}"
        out.write(f"\nrelax doctor failed:\n{traceback.format_exc()}")  # for the maintainer who reads it
    else:
        if info["exit_code"] == 2:  # doctor's own refusal (no metrics, unreadable files)
            info["error"] = out.getvalue().strip().splitlines()[-1] if out.getvalue().strip() else "exit 2"
    return out.getvalue().encode(), info


def replay_command(run_dir: Path, top: str, rollout_id: int) -> str:
    """The run's own overrides (model, rollout, train, ...) with a train-only replay of the
    archived rollout; run where the archive was extracted."""
    overrides = []
    path = run_dir / ".hydra" / "overrides.yaml"
    if path.is_file():
        with contextlib.suppress(Exception):
            overrides = [str(o) for o in OmegaConf.to_container(OmegaConf.load(path))]
    kept = [o for o in overrides if re.split(r"[./=]", o.lstrip("+~"))[0] not in NOT_REPLAYED
            and o.lstrip("+~").partition("=")[0] != "rollout.num_rollout"]
    return shlex.join(["relax", *kept, "debug=train_only",
                       f"debug.load_rollout_data={top}/rollout_data/{{rollout_id}}.pt",
                       f"rollout.num_rollout={rollout_id + 1}"])


# -- the archive --------------------------------------------------------------------------------

def secrets(allowed: list[str]) -> dict[str, bytes]:
    """Values of this environment's secret-looking variables (a config can hold one, resolved
    from ${oc.env:...}), except those the user chose to include."""
    return {name: value.encode() for name, value in os.environ.items()
            if SECRET_NAME.search(name) and len(value) >= 6 and name not in allowed}


def redact(data: bytes, hidden: dict[str, bytes]) -> tuple[bytes, list[str]]:
    found = [name for name, value in hidden.items() if value in data]
    for name in found:
        data = data.replace(hidden[name], f"<redacted ${name}>".encode())
    return data, found


class _Hashing:
    """A file read through sha256 as tarfile copies it (layer dumps can be GBs: never in memory)."""

    def __init__(self, f):
        self.f, self.digest = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        block = self.f.read(n)
        self.digest.update(block)
        return block


def _info(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)  # no owner names or ids: nothing about the user's account
    info.size, info.mtime, info.mode = size, int(mtime), 0o644
    return info


def write_archive(out: Path, contents: Contents, manifest: dict, hidden: dict[str, bytes]) -> dict:
    """The archive at `out`, atomically (a temp file in its dir, renamed when complete)."""
    from relax.files import atomic_open  # (imports torch: versions are read without it)

    entries, redacted = [], []
    with atomic_open(out) as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
        def put(arcname: str, data: bytes, mtime: float, source: str | None) -> None:
            data, found = redact(data, hidden)
            redacted.extend({"path": arcname, "variable": name} for name in found)
            tar.addfile(_info(f"{contents.top}/{arcname}", len(data), mtime), io.BytesIO(data))
            entries.append({"path": arcname, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                            "source": source})

        for arcname, path in sorted(contents.files.items()):
            stat = path.stat()
            if path.suffix in TEXT_SUFFIXES:
                put(arcname, path.read_bytes(), stat.st_mtime, str(path))
                continue
            with open(path, "rb") as src:
                reader = _Hashing(src)
                tar.addfile(_info(f"{contents.top}/{arcname}", stat.st_size, stat.st_mtime), reader)
            entries.append({"path": arcname, "size": stat.st_size, "sha256": reader.digest.hexdigest(),
                            "source": str(path)})
        now = time.time()
        for arcname, data in sorted(contents.generated.items()):
            put(arcname, data, now, None)
        manifest.update(files=entries, redacted=redacted)
        put("MANIFEST.json", json.dumps(manifest, indent=2).encode(), now, None)
    return manifest


def check_output(out: Path) -> None:
    """The archive can be written at `out`: checked before the work, not after it."""
    existing = next(p for p in (out.parent, *out.parent.parents) if p.exists())
    if not existing.is_dir():
        raise BugReportError(f"cannot write {out}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BugReportError(f"cannot write {out}: permission denied in {existing}")


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def progress(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def bugreport(run_dir: Path, out: Path | None, env_names: list[str]) -> tuple[Path, dict]:
    run_dir = run_dir.expanduser().absolute()
    check_run_dir(run_dir)
    top = f"bugreport-{run_dir.name}"
    out = (out.expanduser().absolute() if out else run_dir / f"{top}.tar.gz")
    if out.is_dir():
        out = out / f"{top}.tar.gz"
    check_output(out)
    contents = Contents(top=top)

    progress("running relax doctor on the run")
    doctor_text, doctor_info = run_doctor(run_dir)  # first: it writes the doctor.md taken below
    contents.generated["doctor.txt"] = doctor_text
    progress("collecting the run's files")
    rollout_id = collect_run(run_dir, contents)
    progress("versions, machine, source revision")
    system = {"versions": versions(), "machine": machine(),
              "relax_source": source_revision(Path(relax.__file__).resolve().parent.parent)}
    contents.generated["system.json"] = json.dumps(system, indent=2).encode()
    if env_names:
        contents.generated["environment.json"] = json.dumps(environment(env_names), indent=2).encode()
    manifest = {
        "format_version": 1, "run_dir": str(run_dir),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment_variables": env_names or "none included (relax bugreport --env NAME includes one)",
        "doctor": doctor_info,
        "replay": None if rollout_id is None else {
            "rollout_id": rollout_id, "command": replay_command(run_dir, top, rollout_id),
            "run_from": f"the directory {out.name} was extracted in"},
        "left_out": ["checkpoints/ (model weights)", ".hydra/hydra.yaml (Hydra's runtime; env_set may hold "
                     "secrets)", "environment variables not named with --env"],
        "not_found": contents.missing,
    }
    size = sum(p.stat().st_size for p in contents.files.values())
    progress(f"writing {out} ({len(contents.files) + len(contents.generated) + 1} files, {_size(size)})")
    try:
        manifest = write_archive(out, contents, manifest, secrets(env_names))
    except OSError as e:  # disk full, a read-only file system, a run file that cannot be read
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(out) else ""
        raise BugReportError(f"writing {out}: {e.strerror or e}{where}") from None
    return out, manifest


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="the run's dir (outputs/runs/<date>_<time>)")
    ap.add_argument("-o", "--output", type=Path, default=None,
                    help="the archive to write (default: <run dir>/bugreport-<run name>.tar.gz)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME",
                    help="include this environment variable's value (repeatable; none by default)")
    args = ap.parse_args(argv)
    try:
        out, manifest = bugreport(args.run_dir, args.output, args.env)
    except BugReportError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    missing = ", ".join(m["part"] for m in manifest["not_found"])
    print(f"wrote {out} ({len(manifest['files'])} files{'; not found: ' + missing if missing else ''})")
    if manifest["doctor"].get("error"):
        print(f"relax doctor failed on the run (recorded in doctor.txt): {manifest['doctor']['error']}")
    return 0
