"""What README.md and `relax --help` list against what exists, both ways (tests/test_docs.py
checks each name the docs write; this checks that the lists are whole):

- the tools: relax.cli.SUBCOMMANDS, each named as `relax <tool>` in the README and on the
  tools line of `relax --help` (conf/config.yaml's hydra.help.header), and nothing else there;
- the config groups' options: conf/<group>/*.yaml, each in the README's group table and in
  `relax --help`'s groups, and nothing else there.

Each reader also runs on a bad input, so that a table or line that stopped matching fails here
instead of comparing nothing.
"""

from __future__ import annotations

import re

import pytest

from relax.cli import CONF_DIR, SUBCOMMANDS

from .conftest import REPO, relax_cli

README = (REPO / "README.md").read_text()
CONF_OPTIONS = {d.name: {p.stem for p in d.glob("*.yaml")} for d in CONF_DIR.iterdir() if d.is_dir()}


@pytest.fixture(scope="module")
def help_text(tmp_path_factory) -> str:
    proc = relax_cli("--help", cwd=tmp_path_factory.mktemp("help"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def readme_tools(text: str) -> set[str]:
    """The tools `text` names in inline code: `relax doctor`, `relax compare --layers ...`."""
    return set(re.findall(r"`relax ([a-z][\w-]*)(?=[ `])", text))


def help_tools(text: str) -> set[str]:
    """The tools on `relax --help`'s tools line: `relax inspect | compare ... (tools; ...)`."""
    (line,) = re.findall(r"relax ([\w-]+(?: \| [\w-]+)*) \.\.\. \(tools", text)
    return set(line.split(" | "))


def group_table(text: str) -> dict[str, set[str]]:
    """The README's `| group | options | code |` table: each group's options, the bare words in
    inline code of its options cell (not `group.key=...` nor `rollout.generate_fn`)."""
    table = text.split("| group | options | code |\n", 1)[1].split("\n\n", 1)[0]
    rows = [re.split(r"(?<!\\)\|", line)[1:3] for line in table.splitlines()[1:]]
    return {re.fullmatch(r" `(\w+)` ", group)[1]: set(re.findall(r"`(\w+)`", options))
            for group, options in rows}


def help_groups(text: str) -> dict[str, set[str]]:
    """`relax --help`'s `== Configuration groups ==`: a `group: option, option` line each."""
    section = text.split("== Configuration groups ==\n", 1)[1].split("\n\n\n", 1)[0]
    return {group: set(options.split(", "))
            for group, options in re.findall(r"^(\w+): (.+)$", section, flags=re.M)}


def unlisted_and_unknown(listed: dict[str, set[str]], exist: dict[str, set[str]]) -> dict[str, dict]:
    """Per group: what exists but is not listed, and what is listed but does not exist."""
    return {g: {"unlisted": sorted(exist.get(g, set()) - listed.get(g, set())),
                "unknown": sorted(listed.get(g, set()) - exist.get(g, set()))}
            for g in sorted(listed.keys() | exist.keys()) if listed.get(g) != exist.get(g)}


def test_the_readme_and_relax_help_name_every_tool_and_only_tools(help_text):
    tools = {"tools": set(SUBCOMMANDS)}
    assert not (wrong := unlisted_and_unknown({"tools": readme_tools(README)}, tools)), \
        f"README.md's `relax <tool>` against relax/cli.py's SUBCOMMANDS: {wrong}"
    assert not (wrong := unlisted_and_unknown({"tools": help_tools(help_text)}, tools)), \
        f"relax --help's tools line (conf/config.yaml's hydra.help.header) against SUBCOMMANDS: {wrong}"


def test_the_readme_and_relax_help_list_every_option_of_every_group_and_only_those(help_text):
    assert not (wrong := unlisted_and_unknown(group_table(README), CONF_OPTIONS)), \
        f"README.md's group table against conf/<group>/*.yaml: {wrong}"
    assert not (wrong := unlisted_and_unknown(help_groups(help_text), CONF_OPTIONS)), \
        f"relax --help's groups against conf/<group>/*.yaml: {wrong}"


def test_the_list_readers_read_bad_lists():
    assert readme_tools("`relax doctor RUN`, `relax compare`, `relax x=1`, `relax --help`, relax run") == {
        "doctor", "compare"}
    assert help_tools("Usage: relax [key=value]\n  relax inspect | convert-gguf ... (tools; x)\n") == {
        "inspect", "convert-gguf"}
    table = ("| group | options | code |\n| --- | --- | --- |\n"
             "| `parallel` | `single`, `tp2` (x; `train.lr=1`) | `relax/` |\n"
             "| `model` | `hf` (`model.path=/d`), `rollout.generate_fn` | — |\n\nmore `text`\n")
    assert group_table(table) == {"parallel": {"single", "tp2"}, "model": {"hf"}}
    groups = "== Configuration groups ==\nCompose (group=option)\n\nalgo: grpo\ntrain: megatron, torch\n\n\n"
    assert help_groups(groups + "== Config ==\nseed: 1\n") == {"algo": {"grpo"},
                                                                  "train": {"megatron", "torch"}}
    assert {"parallel", "model", "experiment"} <= CONF_OPTIONS.keys() and "twin" in CONF_OPTIONS["parallel"]
    assert unlisted_and_unknown({"a": {"x", "y"}, "c": {"z"}}, {"a": {"x", "w"}, "b": {"v"}, "c": {"z"}}) == {
        "a": {"unlisted": ["w"], "unknown": ["y"]}, "b": {"unlisted": ["v"], "unknown": []}}
