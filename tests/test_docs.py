"""The docs say what the code does: links resolve, commands parse, CLI samples are the CLI's output, the
options table is the ``Options`` fields, docs/torch_changes.md lists what fsdp_pass changes in torch.

No spawned ranks: the CLI samples and the torch-change scan each run in one fresh process on a fake
process group, the rest reads files and builds argument parsers. ``EXPECTTEST_ACCEPT=1`` rewrites
docs/cli.md's samples from the code, as expecttest does.
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
    # fields made from other options: the two dtypes from mp_policy, inductor from mode and Inductor keys
    assert (defaults.pop("param_dtype"), defaults.pop("reduce_dtype"), defaults.pop("inductor")) == (None, None, {})
    defaults["mp_policy"] = None
    assert set(defaults) == set(Options._NAMES), "a field of Options that is not an option: say here what makes it"
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


# -- commands the docs show -------------------------------------------------------------------------

COMMAND = re.compile(r"(?:\$ )?(?:\w+=\S+ )*((?:python -m fsdp_pass|python (?:benchmarks|examples)/\w+\.py|torchrun)(?:\s.*)?)$")


def doc_commands(path: pathlib.Path) -> list[tuple[str, bool]]:
    """The commands ``path`` shows: (command, written out in a code block) for each line of a fenced
    block (continuations joined, ``$VAR`` set earlier in the block substituted, comments dropped) and
    each inline code span that is one."""
    found = []
    text = path.read_text()
    for block in FENCE.finditer(text):
        assigned: dict[str, str] = {}
        for line in re.sub(r"\\\n\s*", " ", block.group(0)).splitlines()[1:-1]:
            line = line.strip()
            if re.fullmatch(r"\w+=\S+", line):
                name, _, value = line.partition("=")
                assigned[name] = value
            match = COMMAND.match(line.split(" | ")[0])
            if match:
                command = re.sub(r"\$(\w+)", lambda m: assigned.get(m.group(1), m.group(0)), match.group(1))
                found.append((command, True))
    for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", FENCE.sub("", text)):
        match = COMMAND.match(" ".join(span.split()))
        if match:
            found.append((match.group(1), False))
    return found


@contextlib.contextmanager
def _isolated_import():
    """Import scripts without keeping what they set: environment, ``sys.path``, top-level modules of
    benchmarks/ and examples/."""
    environ, path, modules = dict(os.environ), list(sys.path), set(sys.modules)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            file = getattr(sys.modules[name], "__file__", None) or ""
            if file.startswith((str(ROOT / "benchmarks"), str(ROOT / "examples"))):
                del sys.modules[name]


def _exact(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` and its subcommands' parsers taking flags only as written in full (argparse would take
    ``--model`` for ``--models``)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _exact(sub)
    return parser


def script_parser(script: str):
    """A function that parses ``script``'s arguments as the script does (its ``parse_args`` where it has
    one, else its ``build_parser()``), flags written in full, the script imported, not run."""
    if script == "fsdp_pass":
        from fsdp_pass.plan.cli import build_parser

        return _exact(build_parser()).parse_args
    if script.startswith("fsdp_pass."):  # python -m fsdp_pass.<module>
        module = importlib.import_module(script)
        assert hasattr(module, "build_parser"), f"{script} has no build_parser() to check its command lines with"
        return _exact(module.build_parser()).parse_args
    path = ROOT / script
    assert path.is_file(), f"no script {script}"
    with _isolated_import():
        sys.path.insert(0, str(path.parent))  # as `python script` puts it
        spec = importlib.util.spec_from_file_location(f"_doc_script_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while it runs
        spec.loader.exec_module(module)
    assert hasattr(module, "build_parser"), f"{script} has no build_parser() to check its command lines with"
    build = module.build_parser
    module.build_parser = lambda: _exact(build())  # what the script's own parse_args builds
    return getattr(module, "parse_args", lambda args: module.build_parser().parse_args(args))


def command_errors(command: str, in_block: bool, parsers: dict) -> str | None:
    """What is wrong with ``command`` (None: it parses). A command named in prose without any flag
    (``python -m fsdp_pass plan``) may leave out required arguments."""
    tokens = shlex.split(command, comments=True)
    if tokens[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        launched = _parse(_exact(get_args_parser()).parse_args, tokens[1:])
        if isinstance(launched, str):
            return _unless_named_only(launched, tokens[1:], in_block)
        if launched.module or not launched.training_script.startswith(("examples/", "benchmarks/")):
            return None  # a module of another package: torchrun's own flags checked
        script, args = launched.training_script, launched.training_script_args
    elif tokens[:3] == ["python", "-m", "fsdp_pass"]:
        script, args = "fsdp_pass", tokens[3:]
    elif tokens[:2] == ["python", "-m"] and tokens[2].startswith("fsdp_pass."):
        script, args = tokens[2], tokens[3:]
    else:
        script, args = tokens[1], tokens[2:]
    if script not in parsers:
        parsers[script] = script_parser(script)
    error = _parse(parsers[script], args)
    return _unless_named_only(error, args, in_block) if isinstance(error, str) else None


def _unless_named_only(error: str, args: list[str], in_block: bool) -> str | None:
    named_only = not in_block and "required" in error and not any(a.startswith("-") for a in args)
    return None if named_only else error


def _parse(parse, args: list[str]):
    """``parse(args)``, or argparse's error message; ``--help`` is fine."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parse(args)
    except SystemExit as e:
        return None if e.code == 0 else err.getvalue().strip().splitlines()[-1]


def test_every_command_in_the_docs_parses():
    parsers: dict = {}
    commands = [(path, command, in_block) for path in DOCS for command, in_block in doc_commands(path)]
    assert len(commands) > 40, "the command scan found too few commands: is COMMAND still right?"
    wrong = []
    for path, command, in_block in commands:
        error = command_errors(command, in_block, parsers)
        if error:
            wrong.append(f"{path.relative_to(ROOT)}: {command}\n    {error}")
    assert not wrong, "commands in the docs that do not parse:\n" + "\n".join(wrong)


# -- docs/cli.md's samples are the command line's output --------------------------------------------

CLI_DOC = ROOT / "docs" / "cli.md"
# A sample: a fenced block whose first line is ``$ python -m fsdp_pass ...`` (optionally piped into
# ``head -n N`` or ``grep -A N PATTERN``), the rest its output.
SAMPLE = re.compile(r"^```\n\$ (python -m fsdp_pass [^\n|]*?)((?: \| [^\n]*)?)\n(.*?)^```$", re.M | re.S)
_TIMING = re.compile(r"(planned in )[\d.]+( s)")  # the one line that differs between runs

_RUN_SAMPLES = """
import contextlib, io, json, sys
from fsdp_pass.plan.cli import main
out = {}
for args in json.loads(sys.argv[1]):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(args)
    out[" ".join(args)] = printed.getvalue()
print(json.dumps(out))
"""


def _pipe(text: str, pipeline: str) -> str:
    """``text`` through the ``| head -n N`` or ``| grep -A N PATTERN`` a sample shows."""
    for stage in filter(None, (s.strip() for s in pipeline.split("|"))):
        tokens = shlex.split(stage)
        lines = text.splitlines()
        if tokens[:2] == ["head", "-n"]:
            lines = lines[: int(tokens[2])]
        elif tokens[:2] == ["grep", "-A"]:
            first = next(i for i, line in enumerate(lines) if tokens[3] in line)
            lines = lines[first: first + int(tokens[2]) + 1]
        else:
            raise AssertionError(f"a sample pipes into {stage!r}: only head -n and grep -A are replayed")
        text = "\n".join(lines) + "\n"
    return text


def cli_samples(text: str, workdir: pathlib.Path) -> list[tuple[re.Match, str]]:
    """Each sample of ``text`` with the output the command line gives today. Commands run in one fresh
    process in ``workdir`` (``explain`` first: its graphs name process group 0); a ``--model
    module:factory`` whose module the page shows as the ``python`` block just before is written there."""
    samples = list(SAMPLE.finditer(text))
    commands = sorted({tuple(shlex.split(m.group(1))[3:]) for m in samples}, key=lambda args: args[0] != "explain")
    for match in samples:
        args = shlex.split(match.group(1))
        model = args[args.index("--model") + 1] if "--model" in args else ""
        if ":" in model:
            source = re.findall(r"```python\n(.*?)```", text[: match.start()], re.S)[-1]
            (workdir / f"{model.split(':')[0]}.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(workdir), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _RUN_SAMPLES, json.dumps(commands)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = json.loads(done.stdout)
    return [(m, _pipe(outputs[" ".join(shlex.split(m.group(1))[3:])], m.group(2))) for m in samples]


def test_cli_samples_are_the_cli_output(tmp_path):
    """EXPECTTEST_ACCEPT=1 writes today's output into docs/cli.md instead of failing."""
    text = CLI_DOC.read_text()
    samples = cli_samples(text, tmp_path)
    assert len(samples) >= 3, "docs/cli.md has fewer samples than it had (plan, your own model, explain)"
    if os.environ.get("EXPECTTEST_ACCEPT") == "1":
        for match, output in reversed(samples):
            start, end = match.span(3)
            text = text[:start] + output + text[end:]
        CLI_DOC.write_text(text)
        return
    stale = [f"$ {m.group(1)}{m.group(2)}\n--- docs/cli.md\n{m.group(3)}--- today\n{out}" for m, out in samples
             if _TIMING.sub(r"\1…\2", m.group(3)) != _TIMING.sub(r"\1…\2", out)]
    assert not stale, ("docs/cli.md's samples differ from the command line's output (EXPECTTEST_ACCEPT=1 "
                       "python -m pytest tests/test_docs.py -k cli_samples rewrites them):\n" + "\n".join(stale))


def test_cli_flags_table_lists_every_plan_flag():
    from fsdp_pass.plan.cli import build_parser

    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    flags = {s for action in plan._actions for s in action.option_strings if s.startswith("--") and s != "--help"}
    rows = [line for line in FENCE.sub("", CLI_DOC.read_text()).splitlines() if line.startswith("| `--")]
    listed = {flag for row in rows for flag in re.findall(r"`(--[\w-]+)", row.split(" | ")[0])}
    assert flags <= listed, f"plan flags missing from docs/cli.md's table: {sorted(flags - listed)}"
    assert listed <= flags, f"docs/cli.md's table lists flags plan does not have: {sorted(listed - flags)}"


# -- docs/torch_changes.md lists what fsdp_pass changes in torch ------------------------------------

TORCH_CHANGES = ROOT / "docs" / "torch_changes.md"

# Run in a fresh process: import every module of the package (integrations aside: other frameworks),
# do what the test kit does in every rank it starts, compile and step a model with the options that
# install hooks, shard a tensor-parallel model; then find every object of the package that torch's
# modules, their classes (and instances those hold) or their containers refer to.
_SCAN_TORCH = """
import functools, importlib, inspect, json, pathlib, pkgutil, sys, warnings
warnings.simplefilter("ignore")
import torch, torch.nn as nn
import fsdp_pass
from fsdp_pass.testing.fake_pg import fake_process_group
from fsdp_pass.testing.inductor_cache import compile_each_graph_once
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

PACKAGE = pathlib.Path(fsdp_pass.__file__).parent
for info in pkgutil.walk_packages(fsdp_pass.__path__, "fsdp_pass."):
    if info.name != "fsdp_pass.__main__" and not info.name.startswith("fsdp_pass.integrations"):
        importlib.import_module(info.name)
compile_each_graph_once()  # what every rank of fsdp_pass.testing.spawn runs first
with fake_process_group(2):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    opt = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model, backend="vescale", options={
        "compiler": "aot_eager", "min_bucket_bytes": 0, "overlap_last_reduce": True, "step_reduced_first": True,
        "prefetch_next_step": True})
    for _ in range(2):
        compiled(torch.ones(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
with fake_process_group(4):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    parallelize_module(tp, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fsdp_pass.fully_shard(tp, mesh, shard_dim="dp")


def owner(obj):
    for _ in range(4):
        if isinstance(obj, (staticmethod, classmethod)) or inspect.ismethod(obj):
            obj = obj.__func__
        elif isinstance(obj, functools.partial):
            obj = obj.func
    if inspect.isfunction(obj):
        path = pathlib.Path(obj.__code__.co_filename)
    elif isinstance(obj, type):
        path = pathlib.Path(getattr(sys.modules.get(obj.__module__), "__file__", None) or "/")
    else:
        return None
    return path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else None


def contents(value):
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    return list(value) if isinstance(value, (list, tuple, set, frozenset)) else []


found = {}  # the changed object (a container, or an attribute of its holder) -> [locations, owners]


def check(location, value, holder):
    own = owner(value)
    owners = {own} if own else {owner(item) for item in contents(value)} - {None}
    if owners:
        key = (id(holder), location.rsplit(".", 1)[1]) if own else id(value)
        entry = found.setdefault(key, [set(), set()])
        entry[0].add(location)
        entry[1] |= owners


def instance_vars(value):  # the attributes of an instance a torch class holds (a dispatcher), else none
    try:
        plain = not isinstance(value, type) and not callable(value) and not inspect.ismodule(value)
        return list(vars(value).items()) if plain else []
    except Exception:  # no __dict__, or a lazy object that refuses to be looked at
        return []


for name, module in list(sys.modules.items()):
    if not name.startswith("torch") or module is None:
        continue
    for attr, value in list(vars(module).items()):
        check(f"{name}.{attr}", value, module)
        if isinstance(value, type) and value.__module__ == name:
            for cattr, cvalue in list(vars(value).items()):
                check(f"{name}.{attr}.{cattr}", cvalue, value)
                for iattr, ivalue in instance_vars(cvalue):
                    check(f"{name}.{attr}.{cattr}.{iattr}", ivalue, cvalue)
ops = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fsdp_pass::"))
print(json.dumps({"changes": sorted([sorted(l), sorted(o)] for l, o in found.values()), "ops": ops}))
"""


def torch_config_changes() -> dict[str, set[str]]:
    """From the package's sources: the torch config keys set inside ``config.patch(...)`` or Inductor's
    ``compile_fx(config_patches={...})`` (scoped), and assigned to a ``...config.<key>`` attribute
    (process-wide)."""
    changes: dict[str, set[str]] = {"scoped": set(), "process-wide": set()}
    for path in (ROOT / "fsdp_pass").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "patch" \
                    and ast.unparse(node.func.value).endswith("config"):
                changes["scoped"] |= {f"{ast.unparse(node.func.value)}.{k.arg}" for k in node.keywords}
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                changes["scoped"] |= {f"torch._inductor.config.{key}" for key in _config_patch_keys(node)}
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and ast.unparse(target.value).startswith("torch") \
                            and ast.unparse(target.value).endswith("config"):
                        changes["process-wide"].add(ast.unparse(target))
    return changes


def _config_patch_keys(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The literal keys of the dicts ``function`` hands Inductor as ``config_patches=`` (directly, or
    through a name it assigned)."""
    assigned = {target.id: node.value for node in ast.walk(function) if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)}
    keys = set()
    for node in ast.walk(function):
        if isinstance(node, ast.keyword) and node.arg == "config_patches":
            value = assigned.get(node.value.id, node.value) if isinstance(node.value, ast.Name) else node.value
            keys |= {key.value for d in ast.walk(value) if isinstance(d, ast.Dict)
                     for key in d.keys if isinstance(key, ast.Constant)}
    return keys


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}")
    end = text.find("\n## ", start + 1)
    return text[start: end if end > 0 else len(text)]


def test_torch_changes_lists_every_change_fsdp_pass_makes():
    """Every torch attribute, registry, hook table that holds something of the package after using it
    is named on a line of docs/torch_changes.md together with the package file that puts it there
    (``optimizer._global_optimizer_pre_hooks`` ... ``step/sync_check.py``); every custom op and every
    torch config setting the sources change, scoped or process-wide, in its section."""
    done = subprocess.run([sys.executable, "-c", _SCAN_TORCH], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-3000:]
    scan = json.loads(done.stdout.splitlines()[-1])
    text = TORCH_CHANGES.read_text()
    lines = text.splitlines()
    assert len(scan["changes"]) >= 10 and len(scan["ops"]) >= 10, f"the scan found too little: {scan}"
    missing = []
    for locations, owners in scan["changes"]:
        names = {".".join(loc.split(".")[-2:]) for loc in locations}
        for own in owners:
            if not any(own in line and any(name in line for name in names) for line in lines):
                missing.append(f"{' / '.join(sorted(names))} (from fsdp_pass/{own})")
    missing += [f"custom op fsdp_pass::{op}" for op in scan["ops"] if f"`{op}`" not in text]
    configs = torch_config_changes()
    assert configs["scoped"] and configs["process-wide"], f"the config scan found too little: {configs}"
    for kind, heading in (("scoped", "Scoped settings"), ("process-wide", "Process-wide settings")):
        section = _section(text, heading)
        missing += [f"{kind} setting {key}" for key in sorted(configs[kind]) if f"`{key}`" not in section]
    assert not missing, "docs/torch_changes.md does not list:\n" + "\n".join(missing)


# -- the private torch names the sources read, the torch registries they call ------------------------
#
# The rule (docs/torch_changes.md, "Torch internals relied on", says it in words). Each file of the package is
# parsed; the names its imports bind to torch (``import torch``, ``import torch.distributed as dist``,
# ``from torch._inductor import config``, function-local imports too) are its torch aliases, the names they
# bind to any other top-level module (``sys``, ``os``, ``copyreg``, ``transformers``...) its foreign ones.
#   1. A dotted name rooted at a torch alias, or a torch import, with a ``_``-prefixed component (dunders
#      aside) is a private torch name. It is recorded as its longest prefix that is a module of the installed
#      torch (a folder or a .py/.pyi file), the object read off that module, and every part up to its last
#      ``_`` one: ``torch._dynamo.utils.counters``, ``torch.nn.Module._call_impl`` (``.__code__`` dropped),
#      ``torch.ops._c10d_functional`` (``.wait_tensor.default`` dropped).
#   2. A ``_``-prefixed attribute read or written off any other object (``pg._get_backend``, ``x._orig_mod``),
#      or spelled as a whole string (not a docstring, nor a piece of a concatenation or an f-string:
#      ``getattr(m, "_orig_mod")``, ``co_name == "_save_state_dict"``), is a private torch name too, unless:
#      the object is rooted at a foreign alias (``sys._getframe``); or the package defines the name itself
#      (a def or class of that name, a module-level or class-level assignment, an attribute assigned on
#      ``self``/``cls`` or on a def or class of the same file, a module-level string constant: the name of
#      an attribute the package sets, ``_fsdp_pass``-prefixed names); or it is in ``NOT_TORCH`` (other
#      libraries' private names the rule cannot tell from torch's). A name both the package and torch
#      define is the package's by that rule; ``ALSO_TORCH`` names the files where such a name is torch's
#      (read, or overridden by a def). ``UNDERSCORE_FREE`` names torch internals without a ``_`` (read off
#      objects Dynamo hands over) that the package relies on.
#   3. A dotted name rooted at a torch alias whose last part starts with ``register`` or is one of
#      ``REGISTRY_WRITERS`` writes a torch registry: recorded whole (``torch.library.custom_op``).
# Each recorded name must be on a row of the section's tables with each file (its path under fsdp_pass/)
# that uses it, and each row ends with the torch releases it was checked on, within pyproject's range.

NOT_TORCH = {  # private names of Python and of other libraries, read off objects the rule cannot trace
    "_asdict": "a NamedTuple's own method (Python's collections)",
    "_initialize_weights": "transformers' PreTrainedModel method",
    "_is_hf_initialized": "transformers' flag on an initialized module",
    "_get_state_dict": "torchtitan's CheckpointManager method, read off the package's subclass",
}
ALSO_TORCH = {  # names the package defines (so rule 2 takes them as its own) that these files read off torch's objects
    "_apply": {"interop/module_apply.py", "sharding/fsdp_module.py"},  # nn.Module._apply, FSDPModule._apply
    "_buffers": {"buckets/uninitialized.py", "sharding/meta_init.py"},  # nn.Module._buffers
    "_foreach_norm": {"tensor/dispatch.py"},  # aten._foreach_norm (the package's handler has its name)
    "_get_fsdp_state": {"sharding/fsdp_module.py"},  # FSDPModule._get_fsdp_state, overridden
    "_orig_cls_mro_index": {"sharding/fsdp_module.py"},  # read by FSDPModule.__new__
    "_spec": {"tensor/ragged_tensor.py", "buckets/list_kernels.py", "sharding/materialize.py",
              "interop/state_dict.py"},  # DTensor._spec (RaggedShardTensor's own _spec elsewhere)
}
UNDERSCORE_FREE = {  # torch internals without a leading underscore, read off objects torch hands over
    "resolve_source_value": "Dynamo's OutputGraph method",
    "compile_subgraph_reason": "the GraphModule attribute Dynamo sets",
    "get_gradient_edge": "torch.autograd.graph's function (public) whose edge is the live accumulator",
    "cudagraph_annotation": "the GraphModule meta key Dynamo's override_cudagraphs sets",
}
REGISTRY_WRITERS = {"custom_op", "triton_op", "add_safe_globals", "allow_in_graph", "Library"}
TORCH_INTERNALS = "Torch internals relied on"
_PRIVATE_WORD = re.compile(r"_[A-Za-z]\w*")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


@dataclasses.dataclass
class TorchUses:
    """What the source scan finds: each name → the package files (paths under fsdp_pass/) that use it."""

    private: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    registries: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    spelled: set[str] = dataclasses.field(default_factory=set)  # every attribute, string, def and class name


class _FileScan:
    """Rules 1-3 over one parsed file: torch chains, private attribute and string candidates, own names."""

    def __init__(self, tree: ast.Module, torch_dir: pathlib.Path):
        self.torch_dir = torch_dir
        self.aliases: dict[str, str] = {}  # local name → dotted torch path
        self.foreign: set[str] = set()  # local names bound to other top-level modules
        self.chains: set[tuple[str, ...]] = set()  # resolved torch chains
        self.candidates: set[str] = set()  # private names read off other objects, or spelled as strings
        self.own: set[str] = set()  # names this file defines
        self.spelled: set[str] = set()  # every attribute name, string constant, def and class name
        nodes = list(ast.walk(tree))  # breadth first: a chain comes before its inner parts
        self._bind_imports(node for node in nodes if type(node) in (ast.Import, ast.ImportFrom))
        self._read(nodes)
        for stmt in tree.body:  # module level: definitions, and string constants naming the package's attributes
            for target in _assigned(stmt):
                if type(target) is ast.Name:
                    self.own.add(target.id)
                    if type(stmt.value) is ast.Constant and isinstance(stmt.value.value, str):
                        self.own.add(stmt.value.value)

    def _bind_imports(self, imports) -> None:
        for node in imports:
            for name in node.names:
                if type(node) is ast.Import:
                    top, bound = name.name.split(".")[0], name.asname or name.name.split(".")[0]
                    path = name.name if name.asname or top != "torch" else "torch"
                    full = name.name
                elif node.level == 0:
                    top, bound = node.module.split(".")[0], name.asname or name.name
                    path = full = f"{node.module}.{name.name}"
                else:
                    continue  # the package's own modules
                if top == "torch":
                    self.aliases[bound] = path
                    self.chains.add(tuple(full.split(".")))
                else:
                    self.foreign.add(bound)

    def _read(self, nodes: list[ast.AST]) -> None:
        skipped: set[int] = set()  # docstrings, and pieces of a concatenation or an f-string
        inner: set[int] = set()  # nodes inside a longer chain, read with it
        written: list[ast.Attribute] = []  # ``name.attr = ...``
        for node in nodes:
            kind = type(node)
            if kind is ast.Attribute:
                if id(node) in inner:
                    continue
                parts, root = [], node
                while type(root) is ast.Attribute:
                    parts.append(root.attr)
                    root = root.value
                    inner.add(id(root))
                parts.reverse()
                self.spelled.update(parts)
                rooted = type(root) is ast.Name
                if rooted and root.id in self.aliases:
                    self.chains.add((*self.aliases[root.id].split("."), *parts))
                elif not (rooted and root.id in self.foreign):
                    self.candidates.update(part for part in parts if _private(part))
            elif kind is ast.Constant:
                if isinstance(node.value, str):
                    self.spelled.add(node.value)
                    if id(node) not in skipped and _private(node.value) and _PRIVATE_WORD.fullmatch(node.value):
                        self.candidates.add(node.value)
            elif kind is ast.Name:
                if node.id in self.aliases and id(node) not in inner:
                    self.chains.add(tuple(self.aliases[node.id].split(".")))
            elif kind is ast.BinOp:
                skipped.update((id(node.left), id(node.right)))
            elif kind is ast.JoinedStr:
                skipped.update(id(value) for value in node.values)
            elif kind in (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef):
                self.own.add(node.name)
                self.spelled.add(node.name)
                first = node.body[0]
                if type(first) is ast.Expr and type(first.value) is ast.Constant:
                    skipped.add(id(first.value))
                if kind is ast.ClassDef:
                    self.own.update(t.id for stmt in node.body for t in _assigned(stmt) if type(t) is ast.Name)
            elif kind in (ast.Assign, ast.AnnAssign):
                written.extend(t for t in _assigned(node) if type(t) is ast.Attribute and type(t.value) is ast.Name)
            elif kind is ast.Module and node.body and type(node.body[0]) is ast.Expr:
                skipped.add(id(node.body[0].value))
        defined = self.own | {"self", "cls"}  # defs and classes of this file, and the instance or class at hand
        self.own.update(t.attr for t in written if t.value.id in defined)

    def canonical(self, chain: tuple[str, ...]) -> str:
        """Rule 1's recorded form of a private torch chain."""
        modules, path = 0, self.torch_dir.parent
        for part in chain:
            path = path / part
            if not (path.is_dir() or path.with_suffix(".py").is_file() or path.with_suffix(".pyi").is_file()):
                break
            modules += 1
        last_private = max(i for i, part in enumerate(chain) if _private(part))
        return ".".join(chain[:max(modules + 1, last_private + 1)])


def _assigned(stmt: ast.AST) -> list[ast.expr]:
    """The targets ``stmt`` assigns (plain or annotated), tuples unpacked."""
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
    return [t for target in targets for t in ast.walk(target) if isinstance(t, (ast.Name, ast.Attribute))]


def torch_uses_in_sources(package: pathlib.Path = ROOT / "fsdp_pass") -> TorchUses:
    """Rules 1-3 over every file of ``package``: the private torch names and the registry calls, by file."""
    torch_dir = pathlib.Path(importlib.util.find_spec("torch").submodule_search_locations[0])  # not imported
    scans = {path.relative_to(package).as_posix(): _FileScan(ast.parse(path.read_text()), torch_dir)
             for path in sorted(package.rglob("*.py"))}
    own = set().union(*(scan.own for scan in scans.values()))
    uses = TorchUses()
    for file, scan in scans.items():
        for chain in scan.chains:
            if any(_private(part) for part in chain):
                uses.private.setdefault(scan.canonical(chain), set()).add(file)
            if chain[-1].startswith("register") or chain[-1] in REGISTRY_WRITERS:
                uses.registries.setdefault(".".join(chain), set()).add(file)
        for name in scan.candidates:
            if name not in own and not name.startswith("_fsdp_pass") and name not in NOT_TORCH:
                uses.private.setdefault(name, set()).add(file)
        for name, files in ALSO_TORCH.items():  # read, or overridden by a def of the same name
            if file in files and name in scan.spelled:
                uses.private.setdefault(name, set()).add(file)
        uses.spelled |= scan.spelled
        for name in UNDERSCORE_FREE:
            if name in scan.spelled:
                uses.private.setdefault(name, set()).add(file)
    return uses


def _rows(section: str) -> list[str]:
    """The body rows of the markdown tables in ``section`` (each table's header and rule left out)."""
    lines = section.splitlines()
    rule = re.compile(r"\|[\s|:-]+\|$")
    return [line for i, line in enumerate(lines) if line.startswith("|") and not rule.match(line)
            and not (i + 1 < len(lines) and rule.match(lines[i + 1]))]


def _naming(name: str) -> re.Pattern:
    """Matches a code span's text that names ``name``, or a name inside it (``torch._inductor.config.patch``
    names ``torch._inductor.config``; ``ProcessGroup._get_backend`` names ``_get_backend``)."""
    return re.compile(rf"(?<![\w.]){re.escape(name)}(?!\w)" if "." in name else rf"(?<!\w){re.escape(name)}(?!\w)")


def _torch_range() -> "packaging.specifiers.SpecifierSet":
    """The torch releases pyproject.toml admits."""
    from packaging.requirements import Requirement

    text = (ROOT / "pyproject.toml").read_text()
    (line,) = re.findall(r'"(torch[<>=!~][^"]*)"', text)
    return Requirement(line).specifier


def test_torch_changes_lists_every_private_torch_name_and_registry_the_sources_use():
    """Every private torch name the package's sources read and every torch registry they call (the rule above
    ``NOT_TORCH``) is on a row of docs/torch_changes.md's "Torch internals relied on" with each file that uses
    it; each row ends with the torch releases it was checked on, all in pyproject's range; no row names a
    private name the sources no longer use."""
    uses = torch_uses_in_sources()
    assert len(uses.private) >= 40 and len(uses.registries) >= 3, f"the source scan found too little: {uses}"
    for table, names in (("NOT_TORCH", NOT_TORCH), ("UNDERSCORE_FREE", UNDERSCORE_FREE)):
        unused = sorted(set(names) - uses.spelled)
        assert not unused, f"{table} names {unused}, which no file of the package spells any more: drop them"
    for name, files in ALSO_TORCH.items():
        stale = sorted(files - uses.private.get(name, set()))
        assert not stale, f"ALSO_TORCH says {stale} read torch's {name}, but they no longer spell it: drop them"
    rows = _rows(_section(TORCH_CHANGES.read_text(), TORCH_INTERNALS))
    spans = [re.findall(r"`([^`]+)`", row) for row in rows]
    missing = []
    for kind, found in (("private torch name", uses.private), ("registry call", uses.registries)):
        for name, files in sorted(found.items()):
            naming = _naming(name)
            on = [row for row, texts in zip(rows, spans) if any(naming.search(text) for text in texts)]
            for file in sorted(files):
                path = re.compile(rf"(?<![\w/]){re.escape(file)}(?!\w)")
                if not any(path.search(row) for row in on):
                    missing.append(f"{kind} {name} (in fsdp_pass/{file})")
    assert not missing, (f'docs/torch_changes.md\'s "{TORCH_INTERNALS}" has no row naming (in a code span) each of these '
                         f"with its file:\n" + "\n".join(missing))
    supported = _torch_range()
    spelled = uses.spelled | {part for name in [*uses.private, *uses.registries] for part in name.split(".")}
    for row in rows:
        checked = re.findall(r"\b\d+\.\d+\.\d+\b", row.rstrip(" |").rsplit("|", 1)[-1])
        assert checked, f"a row of {TORCH_INTERNALS} does not end with the torch releases it was checked on: {row}"
        outside = [release for release in checked if release not in supported]
        assert not outside, f"releases {outside} are outside pyproject's torch range {supported}: {row}"
        first = row.split("|")[1]
        gone = {word for span in re.findall(r"`([^`]+)`", first) for word in re.findall(r"(?<!\w)_[A-Za-z]\w*", span)
                if word not in spelled}
        assert not gone, f"{TORCH_INTERNALS} names {sorted(gone)}, which no source file spells any more: {row}"


def test_readme_results_table_is_six_one_line_rows_each_linked():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Results"):text.index("## Documentation")]
    rows = [line for line in section.splitlines() if line.startswith("| [")]
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert 1 <= len(rows) <= 6 and len(rows) == len(table) - 2, "README's results: at most six rows, each linked"
    for row in rows:
        assert len(row) <= 200, f"README results row longer than one line: {row}"
        assert re.search(r"\]\([\w./-]+(#[\w-]+)?\)", row) and re.search(r"\d", row), row


def test_concepts_rooms_table_is_the_structure_tests_rooms_in_order():
    spec = importlib.util.spec_from_file_location("_structure", ROOT / "tests" / "test_structure.py")
    structure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(structure)
    text = (ROOT / "docs" / "concepts.md").read_text()
    table = text[text.index("| room | the idea | may import |"):].split("\n\n")[0].splitlines()[2:]
    rooms = [re.match(r"\| (?:`(\w+)/`|(\w+):)", row).group(1) or re.match(r"\| (\w+):", row).group(1)
             for row in table]
    assert rooms == structure.ROOMS, f"docs/concepts.md's rooms {rooms} are not tests/test_structure.py's {structure.ROOMS}"


def test_options_docstring_states_the_real_defaults():
    """Where ``Options``' docstring says ``(default X`` with X a literal, X is the field's default (a
    default of None is said in words there too)."""
    from fsdp_pass.options import Options

    entries = dict(re.findall(r"^ {8}(\w+): (.*?)(?=^ {8}\w+: |\Z)", Options.__doc__, re.M | re.S))
    assert set(option_defaults()) <= set(entries), "Options' docstring documents each option"
    wrong = []
    for name, default in option_defaults().items():
        said = re.search(r"\(default:? ([^\s,;)]+)", " ".join(entries[name].split()))
        try:
            literal = ast.literal_eval(said.group(1).strip(":`")) if said else None
        except (ValueError, SyntaxError):
            continue  # said in words
        if said and literal != default:
            wrong.append(f"{name}: the docstring says default {said.group(1)}, the field's default is {default!r}")
    assert not wrong, "\n".join(wrong)
