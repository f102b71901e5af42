"""The classes and functions config keys name (`<group>._target_`, task.reward_fn, ...):
imported, checked against the call the loop makes, and the extras an option needs, all with
a ConfigError naming the key before anything is built."""

from __future__ import annotations

import importlib.util
import inspect
import sys

from hydra._internal.utils import _locate
from hydra.errors import InstantiationException
from hydra.utils import get_method
from hydra.utils import instantiate as hydra_instantiate

from relax.errors import ConfigError

# What the loop calls each group's class with (README: "The engine, trainer, task and logger are
# the classes ..."): positional arguments, then keywords. Task and logger are built by Hydra's
# instantiate, which also passes the group's other keys as keywords.
CALLS = {
    "rollout": (("rollout", "spec"), ()),
    "train": (("train", "algo", "parallel", "spec"), ("rank", "world_size")),
    "task": ((), ("seed",)),
    "logger": ((), ("run_dir", "resume_from", "run_config")),
    "cluster": (("cluster", "rollout", "train", "algo", "parallel", "run_dir"), ()),
}
INSTANTIATED = ("task", "logger")
# Parameters of an earlier interface, then what replaced them: a class that still takes them
# would bind the new call to the wrong names, so it is refused naming them.
RETIRED = {"train": (("cfg", "model_path"), "relax.train.spec.TrainerSpec"),
           "rollout": (("cfg", "model_path"), "relax.rollout.spec.EngineSpec"),
           "cluster": (("cfg",), "the groups it reads")}


def load_target(group_cfg, group: str):
    """What `<group>._target_` names (`group_cfg`: that group), imported, and able to take the
    call the loop makes (CALLS): a ConfigError naming the key when it does not import or its
    signature lacks a parameter, so a typo in a user's class path stops the run before anything
    is built. A module that refuses to import (require_extra: an extra that is not installed) says so."""
    path = group_cfg._target_
    try:
        target = _locate(path)
        if not callable(target):
            raise ValueError(f"it names a {type(target).__name__}, not a class")
    except (ImportError, ValueError) as e:
        if isinstance(e.__cause__, ConfigError):  # its module refused to import (require_extra)
            raise e.__cause__ from None
        raise ConfigError(f"{group}._target_={path!r} does not import: {e.__cause__ or e}. Expected "
                          f"a dotted path to a class on the Python path, e.g. "
                          f"{group}._target_=my_package.module.MyClass") from None
    if group in CALLS:
        check_signature(target, group, path, group_cfg)
    return target


def check_signature(target, group: str, path: str, group_cfg) -> None:
    """`target` accepts the call CALLS describes for `group` (bound to placeholders, not run)."""
    positional, keywords = CALLS[group]
    if group in INSTANTIATED:
        keywords = (*(k for k in group_cfg if k != "_target_"), *keywords)
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin or C type: nothing to check against
        return
    call = ", ".join([*positional, *(f"{k}=" for k in keywords)])
    old_names, replaced_by = RETIRED.get(group, ((), ""))
    if retired := [name for name in old_names if name in signature.parameters]:
        raise ConfigError(f"{group}._target_={path!r}: its signature {signature} takes {', '.join(retired)}, "
                          f"as the interface before {replaced_by} did; the loop calls it as "
                          f"{target.__name__}({call}) (docs/backends.md describes the interface)")
    try:
        signature.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as e:
        raise ConfigError(f"{group}._target_={path!r}: the loop calls it as {target.__name__}({call}), "
                          f"which its signature {signature} refuses: {e}. Make its signature take that "
                          f"call (relax/{group}/__init__.py describes the interface)") from None


RAY_EXTRA = "the [ray] extra: pip install -c constraints.txt -e '.[ray]'"
# What installs each module an option needs beyond the base install (setup.cfg extras_require).
EXTRAS = {
    "ray": RAY_EXTRA,
    "hydra_plugins.hydra_ray_launcher": RAY_EXTRA,
    "megatron.core": "the [megatron] extra: pip install -c constraints.txt -e '.[megatron]'",
    "gguf": "the [real] extra: pip install -c constraints.txt -e '.[real]'",
    "accelerate": "the [real] extra: pip install -c constraints.txt -e '.[real]'",
    "peft": "the [lora] extra: pip install -c constraints.txt -e '.[lora]'",
    "sglang": ("SGLang, which runs from an environment of its own: build it with "
               "scripts/setup_sglang_cpu.sh (CPU; on GPU pip install sglang), then run "
               ".venv-sglang/bin/relax"),
}


def require_extra(option: str, *modules: str) -> None:
    """A ConfigError naming `option` (e.g. cluster=ray) and what to install when one of the
    modules it needs (keys of EXTRAS) is not installed here. The one place that asks."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package that is missing, or half-installed
            found = False
        if not found:
            raise ConfigError(f"{option} needs the module {module!r}, which is not installed in this "
                              f"environment ({sys.prefix}): install {EXTRAS[module]}")


def load_function(path: str, key: str, expected: str):
    """The function the dotted `path` (the value of config key `key`, e.g. task.reward_fn)
    names, imported: a ConfigError naming the key and the `expected` signature when it does not."""
    try:
        return get_method(path)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"{key}={path!r} does not import: {e.__cause__ or e}. Expected a dotted path "
                          f"to a function {expected}") from None


def instantiate(group_cfg, group: str, **kwargs):
    """Hydra's instantiate for a group whose class needs only its own keys (task, logger):
    `_target_` called with the group's other keys as keyword arguments, plus `kwargs`."""
    load_target(group_cfg, group)
    try:
        return hydra_instantiate(group_cfg, _recursive_=False, _convert_="all", **kwargs)
    except InstantiationException as e:
        if isinstance(e.__cause__, ConfigError):  # the class refused its input: say so plainly
            raise e.__cause__ from None
        raise
