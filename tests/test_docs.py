"""The docs say what the code does: links resolve, commands parse, CLI samples are the CLI's output, the
options table is the ``Options`` fields, docs/torch_changes.md lists what fsdp_pass changes in torch.

Cheap and without process groups (the CLI samples and the torch-change scan run in one subprocess
each). ``EXPECTTEST_ACCEPT=1`` rewrites docs/cli.md's samples from the code, as expecttest does.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "examples" / "README.md",
               *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^(```|~~~)[^\n]*\n.*?^\1[ \t]*$", re.M | re.S)  # a fenced code block


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (links and headings in them do not count)."""
    text = FENCE.sub("", text)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)


# -- links and anchors ------------------------------------------------------------------------------

def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation other than ``-`` and
    ``_`` removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated slug gets ``-1``, ``-2``, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(path: pathlib.Path) -> list[str]:
    """``path``'s relative links whose file or ``#anchor`` does not exist."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}: ({target})"
        if not resolved.exists():
            broken.append(f"{where}: no file {file_part}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{where}: no heading with anchor #{anchor} in {resolved.relative_to(ROOT)}")
    return broken


def test_github_slug_rules():
    assert github_slug("Compile time (2026-12-03, commit 0995137)") == "compile-time-2026-12-03-commit-0995137"
    assert github_slug("`plan`") == "plan"
    assert github_slug("What frameworks call on a sharded model") == "what-frameworks-call-on-a-sharded-model"
    assert github_slug("gloo: functional collectives in flight together corrupt the heap") == \
        "gloo-functional-collectives-in-flight-together-corrupt-the-heap"
    assert github_slug("FSDP × TP [the table](x.md)") == "fsdp--tp-the-table"


def test_every_relative_link_and_anchor_resolves():
    broken = [b for path in DOCS for b in broken_links(path)]
    assert not broken, "broken links:\n" + "\n".join(broken)


# -- the options table ------------------------------------------------------------------------------

def _table_rows(path: pathlib.Path) -> dict[str, list[str]]:
    """Rows of the Markdown tables in ``path`` keyed by a first cell that is one code span."""
    rows = {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        match = re.fullmatch(r"`(\w+)`", cells[0]) if line.startswith("|") else None
        if match:
            rows[match.group(1)] = cells[1:]
    return rows


def option_defaults() -> dict[str, object]:
    """Each option ``Options.from_dict`` accepts, with its default (``mp_policy``: its two dtypes' None)."""
    from fsdp_pass.options import Options

    defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                for f in dataclasses.fields(Options)}
    assert defaults.pop("param_dtype") is None and defaults.pop("reduce_dtype") is None
    defaults["mp_policy"] = None
    assert set(defaults) == set(Options._NAMES)
    return defaults


def test_options_table_lists_every_option_with_its_default():
    """A literal default is the default cell's one code span; a default of None (computed or off) is
    said in words, so that cell holds no literal."""
    rows = _table_rows(ROOT / "docs" / "options.md")
    wrong = []
    for name, default in option_defaults().items():
        if name not in rows:
            wrong.append(f"{name}: no row")
            continue
        cell = rows[name][0]
        literal = re.fullmatch(r"`([^`]+)`", cell)
        if default is None:
            if literal:
                wrong.append(f"{name}: default is None (said in words), the table says {cell}")
        elif not literal or ast.literal_eval(literal.group(1)) != default:
            wrong.append(f"{name}: default is `{default!r}`, the table says {cell}")
    wrong += [f"{name}: a row, but no such option" for name in sorted(set(rows) - set(option_defaults()))]
    assert not wrong, "docs/options.md's table and fsdp_pass/options.py differ:\n" + "\n".join(wrong)
