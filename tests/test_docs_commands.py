"""Every command the README and docs/ show runs somewhere: in CI (a line of ``.ci/run``) or in a named project test.

The commands are the lines of every ``bash``/``sh``/``shell``/``console`` block of README.md and docs/*.md
(continuation lines joined, comments dropped; every fenced block carries a language, so none hides). Each is an
entry of ``WHERE`` below, which says where it runs:

* ``ci()``: the command is a line of ``.ci/run``, character for character.
* ``in_test(*functions)``: the named functions of tests/ (a test, or the fixture or background job it reads) run the
  same program with every option the command shows (the sizes may be smaller: a benchmark's smoke run). Checked
  mechanically: each function exists, and the source of its module names the program and every option.
* ``by_hand(why, *functions)``: what the command needs that neither CI nor a test has (hours of mutmut, a
  FastDeploy checkout, 7 GiB of memory); the functions named, if any, run the nearest smaller form.

Every command's options must also be options its program declares (argparse's ``add_argument``, the plugin's
``addoption``, or pytest's own), and it must run with the venv's interpreter (``.venv/bin/python``), unless its
entry says it runs in another project's environment where the suite is installed (``installed=True``: ``python``,
``pip``, ``weightsync-conformance``). A bare ``pytest`` (outside the venv: ``ModuleNotFoundError: zmq``) is refused
in blocks and in inline code alike.

A new command fails ``test_every_documented_command_is_listed`` until its entry is added here; an entry whose
command left the docs fails ``test_every_listed_command_is_documented``.
"""
from __future__ import annotations

import ast
import functools
import glob
import os
import re
import shlex
from dataclasses import dataclass

import pytest

from tests.conftest import REPO

SHELL = ("bash", "sh", "shell", "console")


@dataclass(frozen=True)
class Where:
    kind: str  # "ci" | "test" | "by hand"
    functions: tuple[str, ...] = ()  # "tests/test_x.py::name"
    why: str = ""
    installed: bool = False  # runs in another project's environment, where the wheel is installed


def ci() -> Where:
    return Where("ci")


def in_test(*functions: str, installed: bool = False) -> Where:
    return Where("test", functions, installed=installed)


def by_hand(why: str, *functions: str) -> Where:
    return Where("by hand", functions, why)


BENCH = "tests/test_benchmarks_smoke.py::"
HISTORY = ("tests/test_history.py::tool", "tests/test_history.py::test_bisect_names_the_first_change_and_runs_fewer_suites_than_versions")
INSTALL = "tests/test_install.py::"
FOUR = {
    ".venv/bin/python -m pytest conformance --impl=reference -n 2": ci(),
    ".venv/bin/python -m pytest tests --durations=15": ci(),
    '.venv/bin/python -m pytest conformance --impl=reference -m "multirank or cycles or restart or pairs"': ci(),
    ".venv/bin/python -m pytest conformance --impl=reference -m multirank --hosts 2": ci(),
}
WHERE: dict[str, Where] = {
    # README.md
    "python3 -m venv .venv": ci(),
    ".venv/bin/pip install -q -e '.[test]'": ci(),
    **FOUR,
    ".venv/bin/python -m pytest conformance --impl=reference --rule BKT --conformance-report out.json": in_test(
        "tests/test_plugin_gate.py::test_rule_prefix_selects_the_area_in_a_real_run", "tests/conftest.py::run_conformance"),
    ".venv/bin/python -m pytest conformance --list-rules": in_test(
        "tests/test_plugin_gate.py::test_list_rules_needs_no_impl_and_lists_every_rule"),
    ".venv/bin/python -m pytest conformance --impl=my_adapter.py:Adapter": in_test(
        "tests/test_readme.py::test_the_readmes_adapter_passes_what_it_claims"),
    "pip install /path/to/weightsync-conformance": in_test(INSTALL + "_installed", installed=True),
    "python -m pytest --pyargs conformance --impl=./my_adapter.py:Adapter": in_test(INSTALL + "_example", installed=True),
    "weightsync-conformance --impl=./my_adapter.py:Adapter --rule SNAP": in_test(INSTALL + "_tools", installed=True),
    ".venv/bin/python -m conformance.history --repo ~/FastDeploy --path fastdeploy/rl/dynamic_weight_manager.py "
    "-o fd-history --rule PART": in_test(*HISTORY),
    ".venv/bin/python -m conformance.history --repo ~/FastDeploy --path fastdeploy/rl/dynamic_weight_manager.py "
    "-o fd-history --bisect PART-ORDER-NUMERIC": in_test(*HISTORY),
    # docs/adapters.md
    ".venv/bin/python -m pytest conformance --impl=docs/example_adapter.py:MineAdapter": in_test(
        "tests/conftest.py::_example_run", "tests/conftest.py::run_conformance"),
    ".venv/bin/python -m pytest conformance --impl=docs/example_adapter.py:MineAdapter --rule FILE": in_test(
        "tests/conftest.py::_example_run", "tests/test_plugin_gate.py::test_rule_prefix_selects_the_area_in_a_real_run"),
    ".venv/bin/python -m pytest conformance --impl=docs/example_adapter.py:MineAdapter --rule FILE-DETACHED "
    "--conformance-report out.json": in_test("tests/conftest.py::_example_run", "tests/conftest.py::run_conformance",
                                           "tests/test_plugin_gate.py::test_rule_prefix_selects_the_area_in_a_real_run"),
    "python -m pytest --pyargs conformance --impl=./my_adapter.py:MyAdapter": in_test(INSTALL + "_example", installed=True),
    "weightsync-conformance --impl=./my_adapter.py:MyAdapter --rule SNAP": in_test(INSTALL + "_tools", installed=True),
    "python -m pytest --pyargs conformance tests/ --impl=./my_adapter.py:MyAdapter": in_test(
        INSTALL + "_tools", INSTALL + "_example", installed=True),
    "python -m conformance.history --versions copies/ -o history --rule PART": in_test(INSTALL + "_tools", installed=True),
    "python -m sim roundtrip --ranks 2 --model-mib 4 --versions 2": in_test(INSTALL + "_tools", installed=True),
    ".venv/bin/python -m pytest conformance --impl=fastdeploy --impl-opt "
    "source=../FastDeploy/fastdeploy/rl/dynamic_weight_manager.py --expectations tests/fd_standins/parts/expectations.toml":
        by_hand("a FastDeploy checkout beside this one; the project tests gate each stand-in generation the same way",
                "tests/test_fastdeploy_adapter.py::_gate_runs"),
    ".venv/bin/python -m conformance.history --repo ~/FastDeploy --path fastdeploy/rl/dynamic_weight_manager.py "
    "--rev-range develop..HEAD --fail-on-regression -o conformance-gate --jobs 2": in_test(
        "tests/test_history.py::gated", "tests/test_history.py::test_the_gate_fails_naming_exactly_the_breaking_commit_and_rule"),
    # docs/benchmarks.md
    ".venv/bin/python -m benchmarks.snapshot_memory --model-mib 1024 --repeat 5": in_test(
        BENCH + "test_snapshot_memory_benchmark_smoke"),
    ".venv/bin/python -m benchmarks.snapshot_memory --model-mib 1024 --repeat 3 --first-load": in_test(
        BENCH + "test_snapshot_memory_first_load_smoke"),
    ".venv/bin/python -m benchmarks.snapshot_parts --parts 2000 --repeat 5": in_test(BENCH + "test_snapshot_parts_benchmark_smoke"),
    ".venv/bin/python -m benchmarks.snapshot_parts --parts 2000 --tensors 200000 --rows 1 --cols 16 --one-file --repeat 3":
        in_test(BENCH + "test_snapshot_parts_one_file_benchmark_smoke"),
    ".venv/bin/python -m benchmarks.fresh_memory --mib 1024 --repeat 5 --gap-s 5": in_test(BENCH + "test_fresh_memory_benchmark_smoke"),
    ".venv/bin/python -m benchmarks.bucket_throughput --model-mib 1024 --buckets 16,64,256,1024 "
    "--png benchmarks/bucket_throughput.png": in_test("tests/test_sim.py::test_benchmark_script_smoke"),
    ".venv/bin/python -m benchmarks.digest_throughput --model-mib 1024 --repeat 7": in_test(
        "tests/test_digest.py::test_benchmark_script_smoke"),
    "MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=17179869184 .venv/bin/python -m benchmarks.prefetch "
    "--loader device": in_test("tests/test_prefetch_benchmark_smoke.py::test_prefetch_benchmark_smoke"),
    ".venv/bin/python -m benchmarks.rank_cycle --model-mib 1024 --cycles 5": in_test(
        "tests/test_rank_cycle_smoke.py::test_rank_cycle_benchmark_smoke"),
    # docs/suite-run-time.md
    ".venv/bin/python -m benchmarks.quick_run_budget --against 3d02fa1 --rounds 5": in_test(
        "tests/test_quick_run_budget_smoke.py::test_quick_run_budget_smoke"),
    # docs/history.md
    ".venv/bin/python -m conformance.history --repo ~/FastDeploy --path fastdeploy/rl/dynamic_weight_manager.py "
    "-o fd-history --rule PART --jobs 2": in_test(*HISTORY),
    ".venv/bin/python -m conformance.history --versions copies/ -o fd-history --rule LEVEL": in_test(
        "tests/test_history.py::tool", "tests/test_history.py::test_a_folder_of_versions_in_manifest_order"),
    # docs/multirank.md
    ".venv/bin/python -m pytest conformance --impl=reference -m huge -k over_2gib": by_hand(
        "about 7 GiB of memory and a minute or two; the quick run proves the same continuation of reads with each "
        "read call capped at 4093 bytes"),
    ".venv/bin/python -m sim.ranks --path bucket --ranks 2 --cycles 3": in_test(
        "tests/test_sim_signals.py::test_sim_ranks_interrupted_leaves_no_process"),
    ".venv/bin/python -m sim.ranks --hosts 2 --cycles 3": in_test("tests/test_sim_signals.py::test_sim_ranks_on_two_hosts"),
    # docs/mutation.md
    ".venv/bin/python -m mutation.report --run --jobs 3": by_hand(
        "mutmut over every mutant of reference/: hours on 2 cores; the report's judgement is tested",
        "tests/test_mutation_report.py::test_an_unjustified_survivor_fails"),
    ".venv/bin/python -m mutation.report --run --only 'reference.buckets.*'": by_hand(
        "mutmut's stats run over the whole selection first: tens of minutes",
        "tests/test_mutation_report.py::test_an_entry_outside_an_only_runs_scope_is_not_judged_by_its_survivors"),
    ".venv/bin/python -m mutation.report": by_hand("the results of a mutmut run in mutants/"),
    ".venv/bin/python -m mutation.justify survivors.tsv": by_hand(
        "the survivors of a mutmut run in mutants/; it appends to mutation/justified.toml"),
    ".venv/bin/python -m mutation.justify --reviewed reference.ipc_meta.x_read_metas": by_hand(
        "a reader's review of the function's entries; it rewrites mutation/justified.toml"),
    ".venv/bin/python -m mutation.current": by_hand(
        "about 30 s of mutmut's mutant generation; the project tests make the same stale check by the functions' "
        "hashes", "tests/test_mutation_report.py::test_every_justification_was_written_for_todays_code"),
    ".venv/bin/python -m mutation.extra --list": in_test("tests/test_mutation_extra.py::test_the_command_line_lists_and_checks"),
    ".venv/bin/python -m mutation.extra --check": in_test("tests/test_mutation_extra.py::test_the_command_line_lists_and_checks"),
    ".venv/bin/python -m mutation.extra --run --workers 2": by_hand(
        "a conformance run per mutant: hours on 2 cores; the project tests check that every mutant compiles and "
        "changes its module",
        "tests/test_mutation_extra.py::test_every_mutant_of_the_reference_compiles_and_changes_its_module"),
    "source .venv/bin/activate && mutation/agreement.sh": by_hand("a mutmut run of its own over reference/agreement.py, "
                                                                  "each mutant judged on two-rank groups"),
    "source .venv/bin/activate && mutation/gate.sh": by_hand("a mutmut run of its own over the CI-gate code (1292 mutants)"),
    # docs/running.md
    ".venv/bin/python -m pytest conformance --impl=reference --rule PART-ORDER-NUMERIC": in_test(
        "tests/test_plugin_gate.py::test_rule_prefix_selects_the_area_in_a_real_run"),
    ".venv/bin/python -m pytest conformance --impl=reference --rule BKT": in_test(
        "tests/test_plugin_gate.py::test_rule_prefix_selects_the_area_in_a_real_run"),
    ".venv/bin/python -m pytest conformance --impl=docs/example_adapter.py:MineAdapter -n 2 --fail-on=all "
    "--expectations known-failures.toml --conformance-report out/mine.json --junitxml out/mine.xml": in_test(
        "tests/test_plugin_gate.py::runs", "tests/test_plugin_gate.py::test_junitxml_carries_rule_and_level",
        "tests/conftest.py::_example_run", "tests/conftest.py::run_conformance"),
    ".venv/bin/python -m pytest conformance --impl=docs/example_adapter.py:MineAdapter --update-expectations "
    "known-failures.toml": in_test("tests/test_plugin_gate.py::test_update_expectations_writes_a_file_that_makes_the_run_green",
                                 "tests/conftest.py::_example_run"),
    ".venv/bin/python -m conformance.matrix out/reference.json out/mine.json -o matrix.html": in_test(
        "tests/test_matrix.py::test_command_line"),
    # docs/simulator.md
    ".venv/bin/python -m sim roundtrip --ranks 2 --model-mib 64 --bucket-mib 16 --versions 3": in_test(
        "tests/test_sim.py::test_the_documented_roundtrip_command"),
    ".venv/bin/python -m sim roundtrip --ranks 2 --model-mib 4 --versions 2 --path meta": in_test(
        "tests/test_sim.py::test_meta_file_path_roundtrip"),
}

# Options of pytest itself and of its plugins the suite depends on (pytest-xdist, pytest-timeout).
PYTEST_OPTIONS = {"-m", "-k", "-n", "-q", "-x", "-p", "--durations", "--junitxml", "--pyargs", "--collect-only",
                  "--tb", "--timeout"}


# -- reading the docs --------------------------------------------------------------------------------------------
def doc_files() -> list[str]:
    return ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]


@functools.cache
def _read(name: str) -> str:
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        return f.read()


FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def _strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment (a ``#`` after whitespace, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def commands_of(text: str) -> list[str]:
    """The commands of every shell block of a page: continuation lines joined, comments dropped, spaces collapsed."""
    out = []
    for block in FENCE.finditer(text):
        if block.group("lang").strip() not in SHELL:
            continue
        pending = ""
        for raw in block.group("body").splitlines():
            line = _strip_comment(raw).strip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line = " ".join((pending + line).split())
            pending = ""
            if line:
                out.append(line)
    return out


@functools.cache
def documented() -> dict[str, list[str]]:
    """command -> the pages that show it."""
    found: dict[str, list[str]] = {}
    for name in doc_files():
        for command in commands_of(_read(name)):
            found.setdefault(command, []).append(name)
    return found


# -- reading a command -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Invocation:
    env: tuple[str, ...]  # VAR of VAR=value prefixes
    interpreter: str  # ".venv/bin/python", "python", "" (a program run directly)
    program: str  # a module after -m, a script's path, or an executable's name
    options: tuple[str, ...]  # "--rule", "-n", ...


def invocations(command: str) -> list[Invocation]:
    out = []
    for part in command.split(" && "):
        words = shlex.split(part)
        env = []
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            env.append(words.pop(0).split("=", 1)[0])
        first, rest = words[0], words[1:]
        if first.endswith("/python") or first in ("python", "python3"):
            if rest[:1] == ["-m"]:
                program, rest = rest[1], rest[2:]
            else:
                program, rest = rest[0], rest[1:]
            interpreter = first
        else:
            interpreter, program = "", first
            if first == "source":
                program, rest = "activate", []
        options = tuple(dict.fromkeys(w.split("=", 1)[0] for w in rest if w.startswith("-") and w != "-"))
        out.append(Invocation(tuple(env), interpreter, program, options))
    return out


@functools.cache
def declared_options(program: str) -> set[str] | None:
    """The options ``program`` declares (None: a program whose options are not checked here, such as pip)."""
    if program in ("pytest", "weightsync-conformance"):
        return PYTEST_OPTIONS | _literals(os.path.join(REPO, "conformance", "plugin.py"))
    path = os.path.join(REPO, *program.split("."))
    if os.path.isdir(path):
        found: set[str] = set()
        for file in glob.glob(os.path.join(path, "**", "*.py"), recursive=True):
            found |= _literals(file)
        return found
    if os.path.isfile(path + ".py"):
        return _literals(path + ".py")
    return None


@functools.cache
def _literals(path: str) -> set[str]:
    """Every string constant of a Python file that looks like an option (``--name`` or ``-x``)."""
    tree = ast.parse(_read(os.path.relpath(path, REPO)), path)
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and re.fullmatch(r"--?[A-Za-z][\w-]*", node.value)}


@functools.cache
def _functions(module: str) -> set[str]:
    tree = ast.parse(_read(module), module)
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _mentions(source: str, option: str) -> bool:
    if not option.startswith("-"):  # an environment variable
        return re.search(rf"\b{re.escape(option)}(?!\w)", source) is not None
    if option.startswith("--"):
        return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", source) is not None
    return re.search(rf"[\"']{re.escape(option)}[\"']", source) is not None


def _program_mentioned(source: str, inv: Invocation) -> bool:
    if inv.program == "pytest":
        return True  # the project runs pytest in-process, forked from its server, or through run_conformance
    if inv.program == "activate":
        return "activate" in source
    if inv.program == "pip":
        return "pip" in source and "install" in source
    return inv.program in source or inv.program.replace("/", ".").removesuffix(".py") in source


# -- the checks --------------------------------------------------------------------------------------------------
def test_every_fenced_block_names_its_language():
    """A block without a language could hold commands no check reads: label it (``bash``, ``text``, ``toml`` ...)."""
    bare = [f"{name}:{text[:m.start()].count(chr(10)) + 1}" for name in doc_files() for text in [_read(name)]
            for m in FENCE.finditer(text) if not m.group("lang").strip()]
    assert not bare, f"fenced blocks without a language: {bare}"


def test_every_documented_command_is_listed():
    missing = {command: pages for command, pages in documented().items() if command not in WHERE}
    assert not missing, (
        "commands in the README or docs/ that no entry of tests/test_docs_commands.py WHERE says where they run "
        "(add each, with the test that runs it or why it runs by hand):\n"
        + "\n".join(f"  {pages}: {command}" for command, pages in missing.items()))


def test_every_listed_command_is_documented():
    gone = sorted(set(WHERE) - set(documented()))
    assert not gone, f"entries of WHERE whose command no page shows any more (remove them): {gone}"


def test_ci_commands_are_lines_of_ci_run():
    ci_lines = [line.strip() for line in _read(os.path.join(".ci", "run")).splitlines()]
    missing = [command for command, where in WHERE.items() if where.kind == "ci" and command not in ci_lines]
    assert not missing, f"commands said to run in CI that are not lines of .ci/run: {missing}"


@pytest.mark.parametrize("command", sorted(WHERE))
def test_the_named_tests_run_the_command(command):
    """Each function named exists, and its module's source names the program and every option of the command (and
    every variable it sets): the test runs the same program the same way, maybe with smaller sizes."""
    where = WHERE[command]
    if where.kind == "ci":
        return
    assert where.kind == "test" or where.why.strip(), f"{command}: a command run by hand says what it needs"
    assert where.kind != "test" or where.functions, f"{command}: name the test that runs it"
    sources = []
    for ref in where.functions:
        module, _, name = ref.partition("::")
        assert name in _functions(module), f"{command}: {ref} is not a function of {module}"
        sources.append(_read(module))
    if where.kind == "by hand":
        return
    source = "\n".join(sources)
    for inv in invocations(command):
        assert _program_mentioned(source, inv), f"{command}: {', '.join(where.functions)} never run {inv.program}"
        unexercised = [o for o in inv.options + inv.env if not _mentions(source, o)]
        assert not unexercised, f"{command}: {', '.join(where.functions)} never pass {unexercised}"


@pytest.mark.parametrize("command", sorted(documented()))
def test_every_option_is_one_its_program_declares(command):
    for inv in invocations(command):
        declared = declared_options(inv.program)
        if declared is None:
            continue
        unknown = [o for o in inv.options if o not in declared]
        assert not unknown, f"{command}: {inv.program} declares no option {unknown}"


@pytest.mark.parametrize("command", sorted(documented()))
def test_commands_run_with_the_venvs_interpreter(command):
    """In the checkout every command runs with ``.venv/bin/python`` (or the venv's pip): a bare ``python`` or
    ``pytest`` fails with ``ModuleNotFoundError: zmq`` outside the venv. Commands for another project's
    environment, where the suite is installed, are marked ``installed`` and use that environment's ``python``."""
    installed = WHERE.get(command, Where("test")).installed
    for inv in invocations(command):
        assert inv.program != "pytest" or inv.interpreter, f"{command}: a bare pytest; write .venv/bin/python -m pytest"
        if command == "python3 -m venv .venv" or inv.program == "activate":
            continue
        first = shlex.split(command.split(" && ")[-1])
        first = next(w for w in first if not re.match(r"^[A-Z_][A-Z0-9_]*=", w))
        if installed:
            assert not first.startswith(".venv/"), f"{command}: marked installed, but runs the checkout's venv"
        elif inv.interpreter:
            assert inv.interpreter == ".venv/bin/python", f"{command}: run it with .venv/bin/python"
        else:
            assert first.startswith((".venv/bin/", "mutation/")), f"{command}: not the venv's ({first})"


def test_no_bare_pytest_in_inline_code():
    """Inline code that starts with ``pytest `` tells a reader to run a bare pytest: ``.venv/bin/python -m pytest``
    in the checkout, ``python -m pytest`` where the suite is installed."""
    found = []
    for name in doc_files():
        text = FENCE.sub("", _read(name))
        found += [f"{name}: `{span}`" for span in re.findall(r"`([^`]+)`", text) if re.match(r"pytest\s", span)]
    assert not found, "inline commands with a bare pytest:\n  " + "\n  ".join(found)


def test_the_reader_of_commands_sees_what_a_shell_would():
    text = ("```bash\n.venv/bin/python -m x --a 1 \\\n    --b 2   # note\n# a comment\nA_B=1 .venv/bin/python -m y "
            "-m \"p or q\" --c=3\n```\n```text\nnot --a command\n```\n")
    assert commands_of(text) == [".venv/bin/python -m x --a 1 --b 2", 'A_B=1 .venv/bin/python -m y -m "p or q" --c=3']
    (inv,) = invocations('A_B=1 .venv/bin/python -m y -m "p or q" --c=3')
    assert inv == Invocation(("A_B",), ".venv/bin/python", "y", ("-m", "--c"))
    assert _strip_comment("echo '#not' # yes") == "echo '#not' "
