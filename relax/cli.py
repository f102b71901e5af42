"""`relax`: the Hydra app, the debugging guide's `--flags`, and the offline tools (SUBCOMMANDS).

`relax [overrides]`, `python -m relax` and `python3 relax/entrypoints/train.py` all land in
`main()`. The guide's flags (`--debug-rollout-only`, `--load-debug-rollout-data PATH`, ...)
are rewritten into the Hydra overrides of the same config keys, so both spellings mix.
Nothing here imports torch: `relax --help` and `relax --cfg job` only compose.
"""

from __future__ import annotations

import difflib
import importlib
import json
import logging
import os
import re
import sys
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from relax import config, process, targets
from relax.errors import ConfigError


def find_conf_dir() -> Path:
    """conf/ next to the package (a source checkout or editable install), else the copy a
    regular install puts under <prefix>/share/relax/conf."""
    for candidate in (Path(__file__).resolve().parent.parent / "conf",
                      Path(sys.prefix) / "share" / "relax" / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise SystemExit("relax: error: cannot find the Hydra config directory (conf/)")


CONF_DIR = find_conf_dir()

# The debugging guide's flags -> (config key, takes a value).
GUIDE_FLAGS = {
    "--debug-rollout-only": ("debug.rollout_only", False),
    "--debug-train-only": ("debug.train_only", False),
    "--save-debug-rollout-data": ("debug.save_rollout_data", True),
    "--load-debug-rollout-data": ("debug.load_rollout_data", True),
    "--save-debug-train-data": ("debug.save_train_data", True),
    "--dump-details": ("debug.dump_details", True),
    "--rollout-num-gpus": ("rollout.rollout_num_gpus", True),
    "--rollout-num-gpus-per-engine": ("rollout.rollout_num_gpus_per_engine", True),
}
# Hydra's own flags pass through untouched (True: the flag takes a value).
HYDRA_FLAGS = {
    "--help": False, "-h": False, "--hydra-help": False, "--version": False,
    "--cfg": True, "-c": True, "--resolve": False, "--package": True, "-p": True,
    "--run": False, "-r": False, "--multirun": False, "-m": False,
    "--shell-completion": False, "-sc": False, "--config-path": True, "-cp": True,
    "--config-name": True, "-cn": True, "--config-dir": True, "-cd": True,
    "--experimental-rerun": True, "--info": False, "-i": False,
}
SUBCOMMANDS = {
    "inspect": "relax.tools.inspect",
    "compare": "relax.tools.compare",
    "doctor": "relax.tools.doctor",
    "bugreport": "relax.tools.bugreport",
    "mismatch": "relax.tools.mismatch",
    "replay-agent": "relax.tools.replay_agent",
    "convert-gguf": "relax.model.gguf",
}


def refuse_unknown_tool(args: list[str]) -> None:
    """`relax inspekt RUN`: a first argument that is a bare word (no `=`, not a flag) can only
    have meant a tool (Hydra would call it an override "missing EQUAL"): exit 2 naming the
    closest tool."""
    if not args or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", args[0]) or args[0] in SUBCOMMANDS:
        return
    close = difflib.get_close_matches(args[0], SUBCOMMANDS, n=1)
    hint = f"did you mean '{close[0]}'?" if close else \
        f"the tools are {', '.join(SUBCOMMANDS)}, and a run takes key=value overrides"
    print(f"relax: error: no tool '{args[0]}'; {hint}", file=sys.stderr)
    sys.exit(2)


class UsageError(SystemExit):
    def __init__(self, message: str):
        super().__init__(f"relax: error: {message}")


def _quote_template(override: str) -> str:
    """Quote values such as `/x/data_{rollout_id}.pt`: Hydra's grammar reads `{` as a dict."""
    key, sep, value = override.partition("=")
    if not sep or not ("{" in value or "}" in value) or value[:1] in "{['\"":
        return override
    return f"{key}='{value}'" if "'" not in value else f'{key}="{value}"'


def translate_args(args: list[str]) -> list[str]:
    """Rewrite the guide's `--flag [value]` into Hydra overrides; refuse unknown flags.

    Overrides go first and Hydra's flags last: Hydra's argparse takes the overrides as one
    positional list, which must not be split by a flag.
    """
    out: list[str] = []
    hydra_flags: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, has_eq, inline = arg.partition("=")
        if name in GUIDE_FLAGS:
            key, takes_value = GUIDE_FLAGS[name]
            if not takes_value:
                if has_eq:
                    raise UsageError(f"{name} takes no value")
                out.append(f"{key}=true")
            else:
                if has_eq:
                    value = inline
                elif i + 1 < len(args) and not args[i + 1].startswith("-"):
                    i += 1
                    value = args[i]
                else:
                    raise UsageError(f"{name} needs a value")
                out.append(_quote_template(f"{key}={value}"))
        elif name in HYDRA_FLAGS:
            hydra_flags.append(arg)
            if HYDRA_FLAGS[name] and not has_eq and i + 1 < len(args):
                i += 1
                hydra_flags.append(args[i])
        elif arg.startswith("-"):
            known = ", ".join(sorted(GUIDE_FLAGS))
            raise UsageError(
                f"unknown flag {arg!r}. Relax flags: {known}; or Hydra flags (--cfg job, "
                f"-m, --help); or key=value overrides (e.g. rollout.num_rollout=10)."
            )
        else:
            out.append(_quote_template(arg))
        i += 1
    return out + hydra_flags


def check_launcher(overrides: list[str]) -> None:
    """hydra/launcher=ray (or ray_aws) without the [ray] extra: Hydra itself would refuse it
    while composing with a bare "Could not find 'hydra/launcher/ray'"."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") == "hydra/launcher" and value in ("ray", "ray_aws"):
            targets.require_extra(f"hydra/launcher={value}", "hydra_plugins.hydra_ray_launcher", "ray")


def with_run_overrides(overrides: list[str]) -> list[str]:
    """`resume=<run or checkpoint>` (or `true`) composes the run's own config: its saved
    overrides go first, the new ones on top (relax/checkpoint/experiment.py). A resume whose
    checkpoint cannot be found is left as it is, for the job to refuse."""
    values = [o.partition("=")[2].strip("'\"") for o in overrides if o.partition("=")[0] == "resume"]
    if not values or values[-1].lower() in ("false", "null", "none", ""):
        return overrides
    # here, not at the top: relax.checkpoint imports torch, which `--help` and `--cfg job` never need
    from relax.checkpoint import experiment_of, find_checkpoint, resumed_run
    from relax.checkpoint.experiment import resume_argv

    run_dir = next((o.partition("=")[2] for o in overrides if o.startswith("hydra.run.dir=")),
                   OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))["hydra"]["run"]["dir"])
    resume = True if values[-1].lower() == "true" else values[-1]
    logging.getLogger("relax.checkpoint").disabled = True  # the job says it again, into relax.log
    try:
        checkpoint = find_checkpoint(resume, Path(run_dir).parent)
        experiment = experiment_of(checkpoint, resumed_run(resume, checkpoint))
    except ConfigError:
        return overrides
    finally:
        logging.getLogger("relax.checkpoint").disabled = False
    return resume_argv(overrides, experiment)


def check_overrides(args: list[str]) -> None:
    """Compose the config once before Hydra runs it, so that a key Hydra cannot merge (a typo, a
    wrong type, an unknown option) is one line and exit 2 like every other refusal, not Hydra's
    report. A sweep (`-m`) and Hydra's own information flags are left to Hydra."""
    if any(a.split("=")[0] in HYDRA_FLAGS and a.split("=")[0] not in ("--cfg", "-c", "--resolve")
           for a in args):
        return

    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            compose("config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        text = "\n".join(str(x) for x in (e, e.__cause__) if x).split("Config search path:")[0]
        said = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith((" ", "\t"))]
        options = [line.strip() for line in text.splitlines() if line.startswith("\t")]
        key = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                    if line.strip().startswith("full_key:")), None)
        raise ConfigError(f"{key + ': ' if key else ''}{'; '.join(said)}"
                          f"{' ' + ', '.join(options) if options else ''}") from None


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_app(cfg: DictConfig) -> None:
    from relax.loop import run_job  # imports torch: only when a job really runs

    run_job(cfg)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    refuse_unknown_tool(args)
    if args and args[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[args[0]])
        sys.exit(module.main(args[1:]))
    config.register()
    sys.argv = [sys.argv[0], *translate_args(args)]
    try:
        sys.argv = [sys.argv[0], *with_run_overrides(sys.argv[1:])]
        check_launcher(sys.argv[1:])
        check_overrides(sys.argv[1:])
    except ConfigError as e:  # a Relax refusal: exit 2 (docs/reliability.md)
        print(f"relax: error: {e}", file=sys.stderr)
        sys.exit(2)
    before = os.environ.get("RELAX_ARGV")
    os.environ["RELAX_ARGV"] = json.dumps(sys.argv[1:])  # for jobs run in other processes (sweeps on Ray)
    try:
        hydra_app()
    except KeyboardInterrupt:  # Ctrl-C before a run started (a run handles its own: relax.process)
        raise SystemExit("relax: interrupted") from None
    finally:  # a caller's environment (tests call main in-process) is left as it was
        if before is None:
            os.environ.pop("RELAX_ARGV")
        else:
            os.environ["RELAX_ARGV"] = before
        failed = process.take_failed_jobs()
    if failed:  # a sweep's jobs that ended with a user error, each said why in one line
        print(f"relax: error: {len(failed)} job(s) of the sweep ended with an error (above): "
              f"{', '.join(failed)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
