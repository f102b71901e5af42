"""README.md and docs/*.md against the code, where a test can tell:

(a) every config key they write as `group.key=...` or `` `group.key` `` exists in the composed
    schema (the default config, or the group option whose YAML pulls in the option schema that
    holds the key: relax.config.OPTION_SCHEMAS), except the few in NOT_KEYS; every option they
    choose as `group=option` is a file conf/<group>/<option>.yaml;
(b) every `relax ...` command line of their shell code blocks composes (the guide's `--flags`
    through relax.cli.translate_args, a `-m` sweep expanded job by job); a tool command
    (`relax compare`, `doctor`, `inspect`) parses with that tool's own argument parser, and
    each tool's `--help` exits 0;
(c) every relative link points to a file that exists;
(d) every repository path they name (relax/..., tests/..., conf/..., scripts/..., bench/...)
    exists, and every dotted `relax.…` name imports.
Each check is also run on a bad input of its kind, so that a pattern that stopped matching
the docs fails here instead of passing on nothing. That the README's and `relax --help`'s lists
of tools and options are whole: tests/test_docs_listings.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from relax.cli import CONF_DIR, HYDRA_FLAGS, SUBCOMMANDS, translate_args
from relax.config import OPTION_SCHEMAS, RelaxConfig

from .conftest import REPO, make_cfg
from .extras import RAY, require

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GROUPS = sorted(f.name for f in dataclasses.fields(RelaxConfig)  # model, rollout, train, ...
                if dataclasses.is_dataclass(f.default_factory))

# Keys the docs name on purpose although no schema has them (planned or removed), with the reason.
NOT_KEYS: dict[str, str] = {  # inline code that reads like a key but is not one
    "model.embed_tokens": "an HF module name (docs/debugging.md, layer dumps)",
    "model.norm": "an HF module name (docs/debugging.md, layer dumps)",
}


def doc_id(path: Path) -> str:
    return str(path.relative_to(REPO))


def all_docs() -> str:
    return "\n".join(d.read_text() for d in DOCS)


# -- (a) config keys and options ---------------------------------------------------------------

_KEY = rf"(?:{'|'.join(GROUPS)})\.[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
OVERRIDE = re.compile(rf"(?<![\w./~+-])[+~]{{0,2}}({_KEY})=")  # rollout.num_rollout=10
INLINE = re.compile(rf"`[+~]{{0,2}}({_KEY})`")  # `train.lr`
FILE_SUFFIXES = {"json", "jsonl", "py", "pt", "yaml", "md", "safetensors", "log", "png", "txt", "jinja", "sh"}
CONF_GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())  # model, ..., experiment
CHOICE = re.compile(rf"(?<![\w./~+-])({'|'.join(CONF_GROUPS)})=([\w,]+)")  # parallel=single,tp2


def config_keys(text: str) -> set[str]:
    """The config keys `text` writes as an override or as inline code (not file names such as
    `model.safetensors`, nor attributes such as cfg.train.lr)."""
    keys = set(OVERRIDE.findall(text))
    keys |= {k for k in INLINE.findall(text) if k.rsplit(".", 1)[1] not in FILE_SUFFIXES}
    return keys


def option_choices(text: str) -> set[str]:
    """The `group=option` choices `text` writes (each option of a comma list)."""
    return {f"{group}={o}" for group, options in CHOICE.findall(text) for o in options.split(",") if o}


@cache
def composed(option: str | None) -> DictConfig:
    return make_cfg(*([option] if option else []))


def option_overrides(group: str) -> list[str]:
    """`group=option` for each option of `group` whose YAML file pulls in an option schema
    (relax.config.OPTION_SCHEMAS: `defaults: [/relax_schema_..._<name>@_here_, _self_]`)."""
    return [f"{group}={path.stem}" for path in sorted((CONF_DIR / group).glob("*.yaml"))
            if any(f"/{name}@" in path.read_text() for name in OPTION_SCHEMAS)]


def has_key(cfg: DictConfig, key: str) -> bool:
    """Whether the dotted `key` is in `cfg`; below a free-form dict (rollout.sglang_server_args,
    cluster.resources_per_engine, ...) any sub-key is."""
    node = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig):
            return False
        if OmegaConf.get_type(node) is dict:
            return True
        if part not in node.keys():
            return False
        node = node._get_node(part)
    return True


def where_defined(key: str) -> str | None:
    """The command-line choice under which `key` exists ('' for the default config), or None."""
    if has_key(composed(None), key):
        return ""
    for option in option_overrides(key.split(".", 1)[0]):
        if has_key(composed(option), key):
            return option
    return None


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_config_key_the_docs_write_exists(doc):
    keys = config_keys(doc.read_text()) - NOT_KEYS.keys()
    missing = sorted(k for k in keys if where_defined(k) is None)
    assert not missing, f"{doc_id(doc)} names config keys that no schema has: {missing}"


@pytest.mark.parametrize("key", sorted(NOT_KEYS))
def test_each_not_key_is_named_by_a_doc_and_absent_from_the_schema(key):
    assert key in config_keys(all_docs()), f"no doc names {key} any more: drop it from NOT_KEYS"
    assert where_defined(key) is None, f"{key} is a config key now: drop it from NOT_KEYS"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_option_the_docs_choose_exists(doc):
    missing = sorted(c for c in option_choices(doc.read_text())
                     if not (CONF_DIR / c.split("=")[0] / f"{c.split('=')[1]}.yaml").is_file())
    assert not missing, f"{doc_id(doc)} chooses options that conf/ does not have: {missing}"


def test_the_key_check_finds_keys_of_every_kind_and_refuses_typos():
    assert where_defined("train.lr") == "" and where_defined("train.async") == ""
    assert where_defined("train.attention_backend") == "train=megatron"
    assert where_defined("rollout.mem_fraction_static") == "rollout=sglang"
    assert where_defined("task.data_path") == "task=jsonl"
    assert where_defined("cluster.num_cpus_per_rank") == "cluster=ray"
    assert where_defined("model.tiny.num_experts") == ""
    assert where_defined("rollout.sglang_server_args.enable_deterministic_inference") == "rollout=sglang"
    for bad in ("debug.dump_layerz", "train.lrr", "model.tiny.nope", "rollout.temperature.x"):
        assert where_defined(bad) is None, bad
    assert config_keys("`debug.dump_layerz`, run with +train.lrr=1, not `model.safetensors` or "
                       "cfg.train.lr=2 or relax.train.x=1") == {"debug.dump_layerz", "train.lrr"}
    assert option_choices("`relax -m parallel=single,tp2 model=hf` or hydra/launcher=ray") == {
        "parallel=single", "parallel=tp2", "model=hf"}
    assert len(config_keys(all_docs())) >= 80 and len(option_choices(all_docs())) >= 20


# -- (b) command lines -------------------------------------------------------------------------

ENTRY = re.compile(r"(?:\S*/)?relax")  # relax, .venv/bin/relax, .venv-sglang/bin/relax
PYTHON_ENTRIES = (["relax/entrypoints/train.py"], ["-m", "relax"])  # python3 <entry> ...


def shell_blocks(text: str) -> list[str]:
    """The shell code blocks (```bash) of `text`; other blocks hold output, Python or JSON."""
    return re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", text, flags=re.S | re.M)


def command_lines(text: str) -> list[list[str]]:
    """The arguments of every `relax` command in the shell blocks of `text`: after `relax`,
    `python3 relax/entrypoints/train.py` or `python -m relax`; a `...` (more of your own) dropped."""
    out = []
    for block in shell_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            for segment in re.split(r"&&|\|\||;|\|", line):
                try:
                    words = shlex.split(segment, comments=True)
                except ValueError:  # `ray start --address=<A's IP>:6379`: not a relax command
                    if ENTRY.fullmatch((segment.split() or [""])[0]):
                        raise
                    continue
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value relax ...
                    words.pop(0)
                if words and ENTRY.fullmatch(words[0]):
                    args = words[1:]
                elif words and re.fullmatch(r"(?:\S*/)?python3?", words[0]) and any(
                        words[1:1 + len(e)] == e for e in PYTHON_ENTRIES):
                    args = words[1 + next(len(e) for e in PYTHON_ENTRIES if words[1:1 + len(e)] == e):]
                else:
                    continue
                out.append([a for a in args if a != "..."])
    return out


def split_hydra_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """translate_args's output split into (overrides, Hydra's own flags with their values)."""
    overrides, flags = [], []
    it = iter(translate_args(args))
    for arg in it:
        name, has_eq, _ = arg.partition("=")
        if name in HYDRA_FLAGS:
            flags.append(arg)
            if HYDRA_FLAGS[name] and not has_eq:
                flags.append(next(it))
        else:
            overrides.append(arg)
    return overrides, flags


def jobs(args: list[str]) -> list[list[str]]:
    """The overrides of each job a command runs: one, or with -m the product of its comma lists."""
    overrides, flags = split_hydra_flags(args)
    if "-m" not in flags and "--multirun" not in flags:
        return [overrides]
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
               else [text] for o, text in zip(parsed, overrides, strict=True)]
    return [list(job) for job in itertools.product(*choices)]


def is_tool(args: list[str]) -> bool:
    return bool(args) and args[0] in SUBCOMMANDS


COMMANDS = [(doc, args) for doc in DOCS for args in command_lines(doc.read_text())]


def command_id(x) -> str:
    return doc_id(x) if isinstance(x, Path) else " ".join(x)[:80]


@pytest.mark.parametrize("doc,args", [c for c in COMMANDS if not is_tool(c[1])], ids=command_id)
def test_every_relax_command_composes(doc, args):
    if "hydra/launcher=ray" in args:
        require("hydra_plugins.hydra_ray_launcher", RAY)
    for job in jobs(args):
        make_cfg(*job)  # raises on an unknown key or option, a wrong type, a comma list without -m


class Parsed(Exception):
    """Raised by the patched parse_args instead of letting the tool run."""


def parse_tool_args(args: list[str], monkeypatch) -> argparse.Namespace:
    """`relax <tool> ...` parsed by the tool's own parser (a bad flag exits 2), not run."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_only(self, argv=None, namespace=None):
        raise Parsed(parse_args(self, argv, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    with pytest.raises(Parsed) as parsed:
        importlib.import_module(SUBCOMMANDS[args[0]]).main(args[1:])
    monkeypatch.undo()
    return parsed.value.args[0]


@pytest.mark.parametrize("doc,args", [c for c in COMMANDS if is_tool(c[1])], ids=command_id)
def test_every_tool_command_parses(doc, args, monkeypatch):
    parse_tool_args(args, monkeypatch)


@pytest.mark.parametrize("tool", sorted(SUBCOMMANDS))
def test_every_tool_has_help(tool, capsys):
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(SUBCOMMANDS[tool]).main(["--help"])
    assert exit_.value.code == 0 and f"relax {tool}" in capsys.readouterr().out


def test_the_docs_hold_relax_commands_of_every_kind():
    readme = [args for doc, args in COMMANDS if doc.name == "README.md"]
    assert len(readme) >= 15
    assert any("-m" in a for a in readme) and any(is_tool(a) for a in readme)
    assert any(a and a[0] == "--debug-rollout-only" for a in readme)


def test_the_command_checks_refuse_bad_commands(monkeypatch):
    text = ("```bash\nFOO=1 relax a=1 \\\n  b=2 ...  # c\nrelax compare x && python -m relax c=3\n"
            "python3 relax/entrypoints/train.py --dump-details /x\nray start\n```\n```\nrelax d=4\n```\n")
    assert command_lines(text) == [["a=1", "b=2"], ["compare", "x"], ["c=3"], ["--dump-details", "/x"]]
    assert jobs(["-m", "parallel=single,tp2", "--debug-rollout-only"]) == [
        ["parallel=single", "debug.rollout_only=true"], ["parallel=tp2", "debug.rollout_only=true"]]
    for bad in (["train.lrr=1"], ["-m", "parallel=single,tp5"], ["parallel=single,tp2"], ["model=nope"]):
        with pytest.raises(ConfigCompositionException):
            for job in jobs(bad):
                make_cfg(*job)
    assert parse_tool_args(["compare", "a", "b", "--baseline", "tp2"], monkeypatch).baseline == "tp2"
    with pytest.raises(SystemExit) as exit_:
        parse_tool_args(["compare", "x", "--no-such-flag"], monkeypatch)
    assert exit_.value.code == 2


# -- (c) links ---------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]


def missing_links(doc: Path, text: str) -> list[str]:
    return [t for t in relative_links(text) if not (doc.parent / t.split("#")[0]).exists()]


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_relative_link_points_to_a_file(doc):
    missing = missing_links(doc, doc.read_text())
    assert not missing, f"{doc_id(doc)} links to files that do not exist: {missing}"


def test_the_link_check_sees_links():
    assert relative_links("[a](docs/x.md) [b](https://x.org/y) [c](#top) [d](../e.md#s)") == [
        "docs/x.md", "../e.md#s"]
    assert missing_links(REPO / "docs" / "models.md", "[a](backends.md#x) [b](nope.md)") == ["nope.md"]
    assert sum(len(relative_links(d.read_text())) for d in DOCS) >= 20


# -- (d) paths and Python names ----------------------------------------------------------------

PATH = re.compile(r"(?<![\w./<-])((?:relax|tests|conf|scripts|bench|docs|\.ci)/[\w./-]*[\w/])")
PLACEHOLDER = re.compile(r"[\w./-]*(?:<|\{|\*|…)")  # relax/model/families/<family>.py, ...
CREATED = {"bench/.venv-trl": "built by bench/vs_trl.py on its first run (git-ignored)"}
NAME = re.compile(r"(?<![\w./-])(relax(?:\.[A-Za-z_]\w*)+)")


def repo_paths(text: str) -> set[str]:
    """The repository paths `text` names, without placeholders (`<family>`, `{rollout_id}`) and
    test ids (`tests/x.py::test_y`)."""
    text = PLACEHOLDER.sub(" ", text)
    return {m for m in PATH.findall(text)}


def missing_path(path: str, doc: Path) -> bool:
    if any(path == c or path.startswith(c + "/") for c in CREATED):
        return False
    return not (REPO / path).exists() and not (doc.parent / path).exists()


def python_name_imports(name: str) -> bool:
    """Whether `relax.a.b.c` is a module, or an attribute of the longest module prefix."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_path_and_python_name_the_docs_write_exists(doc):
    text = doc.read_text()
    missing = sorted(p for p in repo_paths(text) if missing_path(p, doc))
    assert not missing, f"{doc_id(doc)} names paths that do not exist: {missing}"
    names = {n for n in NAME.findall(text) if n.rsplit(".", 1)[1] not in FILE_SUFFIXES}
    broken = sorted(n for n in names if not python_name_imports(n))
    assert not broken, f"{doc_id(doc)} names Python objects that do not import: {broken}"


def test_the_path_and_name_checks_see_bad_ones():
    assert repo_paths("`relax/loop.py`, tests/test_x.py::test_y, relax/model/families/<family>.py, "
                      "conf/<group>/<option>.yaml and bench/x.py.") == {
        "relax/loop.py", "tests/test_x.py", "bench/x.py"}
    assert missing_path("relax/nope.py", REPO / "README.md") and not missing_path("relax/loop.py", REPO)
    assert not missing_path("bench/.venv-trl/bin/python", REPO)
    assert python_name_imports("relax.loop.rl_loop") and python_name_imports("relax.train")
    assert not python_name_imports("relax.loop.no_such_thing") and not python_name_imports("relax.nope")
    assert len(repo_paths(all_docs())) >= 40
