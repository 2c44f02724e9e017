"""Find the ``$ hyper-parallel ...`` commands that a Markdown page shows with their output, run them and
compare, so a page cannot show output the command no longer prints.

A command block is a fenced block (any language) with a line that starts with ``$ hyper-parallel``.
Each ``$`` line is a command; the lines after it, up to the next ``$`` line or the end of the block,
are its expected output (stdout and stderr together, in the order printed). The commands of a page
run in page order, with the Python that runs the tests (``python -m hyper_parallel.cli``),
``COLUMNS=120`` and ``PYTHONUNBUFFERED=1``, in one scratch folder per page that links every entry of
the repository root (so ``examples/pipeline_mlp.py`` is found there) and receives the files the
commands write. The exit code is not compared; what the command prints is.

How the output compares: trailing spaces of every line and blank lines at the end are ignored; every
other character must match, except where the page says otherwise:

- a line that is only ``...`` stands for any number of lines (none included);
- a line that ends with `` ...`` matches a line that starts with the text before it, and stands for
  any lines after that one (e.g. ``usage: hyper-parallel profile [-h] ...`` for a long usage);
- ``<!-- command: numbers -->`` on the line before the block (blank lines between are allowed):
  every number in the block's output matches any number and runs of spaces match any run of spaces
  (for measured times and sizes; the words around them must still match).

Other markers, invisible on the rendered page:

- ``<!-- command: skip: REASON -->`` before a block: its commands do not run; the reason is
  required (e.g. it needs a GPU or a cluster, or takes minutes).
- ``<!-- command-file: NAME -->`` before a fenced block (a ```json costs file the page shows): the
  block's text is written to NAME in the page's scratch folder before later commands run.
- ``<!-- command-file: NAME`` followed by lines up to ``-->``: the same for a file the page does not
  show (bad input for an error example).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

PROMPT = "$ "
COMMAND = "hyper-parallel"
COLUMNS = "120"

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*command:\s*(.*?)\s*-->\s*$")
_FILE_MARK = re.compile(r"^\s*<!--\s*command-file:\s*(\S+)\s*-->\s*$")
_FILE_OPEN = re.compile(r"^\s*<!--\s*command-file:\s*(\S+)\s*$")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_PATTERN = r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?"


@dataclass
class Command:
    """One ``$ hyper-parallel ...`` line of a page and the output the page shows for it."""

    path: str
    line: int
    argv: list[str]
    expected: list[str]
    numbers: bool = False
    skip: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class Page:
    """What one page asks for, in page order: files to write and commands to run."""

    path: str
    steps: list[tuple[str, object]] = field(default_factory=list)  # ("file", (name, text)) | ("command", Command)

    @property
    def commands(self) -> list[Command]:
        return [item for kind, item in self.steps if kind == "command"]


def _directive(path: str, line: int, text: str) -> tuple[str | None, bool]:
    """(skip reason, numbers) from a ``command:`` marker's text."""
    text = text.strip()
    if text.startswith("skip"):
        reason = text[len("skip"):].lstrip(" :").strip()
        if not reason:
            raise ValueError(f"{path}:{line}: 'command: skip' needs a reason, got {text!r}")
        return reason, False
    if text == "numbers":
        return None, True
    raise ValueError(f"{path}:{line}: unknown command directive {text!r} (skip: REASON | numbers)")


def _split_commands(path: str, start: int, body: list[str], numbers: bool, skip: str | None) -> list[Command]:
    commands: list[Command] = []
    for offset, line in enumerate(body):
        where = f"{path}:{start + offset + 1}"
        if line.startswith(PROMPT):
            words = shlex.split(line[len(PROMPT):])
            if not words or words[0] != COMMAND:
                raise ValueError(f"{where}: a command block runs only `{PROMPT}{COMMAND} ...` lines, got {line!r}")
            commands.append(Command(path, start + offset + 1, words[1:], [], numbers, skip))
        elif not commands:
            raise ValueError(f"{where}: a command block starts with its `{PROMPT}{COMMAND}` line, got {line!r}")
        else:
            commands[-1].expected.append(line.rstrip())
    for command in commands:
        while command.expected and not command.expected[-1]:
            command.expected.pop()
    return commands


def parse(text: str, path: str) -> Page:
    """The files and commands of one Markdown text, in page order."""
    lines = text.splitlines()
    page = Page(path)
    pending: tuple[int, str] | None = None  # (line, directive) waiting for its block
    pending_file: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        mark, file_mark, file_open, fence = (
            _MARK.match(line), _FILE_MARK.match(line), _FILE_OPEN.match(line), _FENCE.match(line))
        if mark:
            pending = (i + 1, mark.group(1))
        elif file_mark:
            pending_file = file_mark.group(1)
        elif file_open:
            name, body = file_open.group(1), []
            i += 1
            while i < len(lines) and lines[i].strip() != "-->":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"{path}: the command-file comment for {name} never ends")
            page.steps.append(("file", (name, textwrap.dedent("\n".join(body)) + "\n")))
        elif fence:
            indent = len(fence.group(1))
            start, body = i, []
            i += 1
            while i < len(lines) and not (_FENCE.match(lines[i]) and _FENCE.match(lines[i]).group(2) == ""):
                body.append(lines[i][indent:] if lines[i].startswith(" " * indent) else lines[i].lstrip())
                i += 1
            if pending_file is not None:
                page.steps.append(("file", (pending_file, "\n".join(body) + "\n")))
            elif any(b.startswith(PROMPT + COMMAND) for b in body):
                skip, numbers = _directive(path, pending[0], pending[1]) if pending else (None, False)
                page.steps.extend(("command", c) for c in _split_commands(path, start + 1, body, numbers, skip))
            elif pending is not None:
                raise ValueError(f"{path}:{start + 1}: 'command: {pending[1]}' stands before a block without "
                                 f"a `{PROMPT}{COMMAND}` line")
            pending = pending_file = None
        elif line.strip() and (pending is not None or pending_file is not None):
            what = f"command: {pending[1]}" if pending else f"command-file: {pending_file}"
            raise ValueError(f"{path}:{i + 1}: '{what}' is not followed by a fenced block")
        i += 1
    if pending is not None or pending_file is not None:
        raise ValueError(f"{path}: a command marker at the end of the page has no block")
    return page


def expected_pattern(expected: list[str], numbers: bool = False) -> re.Pattern:
    """The regular expression the whole output must match (see the module docstring)."""
    parts: list[str] = []
    for line in expected:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
            continue
        rest = ""
        if line.endswith(" ..."):
            line, rest = line[: -len(" ...")], r"[^\n]*(?:\n[^\n]*)*?"
        if numbers:
            pieces = _NUMBER.split(line)
            text = _NUMBER_PATTERN.join(re.sub(r"(?:\\ )+", " +", re.escape(p)) for p in pieces)
            text = re.sub(r"^ \+", " *", re.sub(r"(?: \+)+", " +", text))
        else:
            text = re.escape(line)
        parts.append(text + rest + r"\n")
    return re.compile("".join(parts))


def normalise(output: str) -> str:
    """The output as compared: trailing spaces and trailing blank lines gone, one newline at the end."""
    lines = [line.rstrip() for line in output.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return "".join(line + "\n" for line in lines)


def matches(expected: list[str], output: str, numbers: bool = False) -> bool:
    return expected_pattern(expected, numbers).fullmatch(normalise(output)) is not None


def scratch_folder(repo_root: str, folder: str) -> None:
    """Link every entry of the repository root into ``folder`` (the commands' working directory)."""
    for name in os.listdir(repo_root):
        if not os.path.exists(os.path.join(folder, name)):
            os.symlink(os.path.join(repo_root, name), os.path.join(folder, name))


def run_command(command: Command, cwd: str, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run one command as the page shows it; returns its stdout and stderr, interleaved as printed."""
    full_env = dict(os.environ if env is None else env)
    full_env.update(COLUMNS=COLUMNS, PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "hyper_parallel.cli", *command.argv], cwd=cwd, env=full_env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{command.where}: `{COMMAND} {shlex.join(command.argv)}` ran past {timeout} s") from exc
    return done.stdout


def run_page(page: Page, repo_root: str, cwd: str, timeout: float, env: dict[str, str] | None = None) -> int:
    """Write the page's files and run its commands in ``cwd``; returns how many ran. Raises on a mismatch."""
    scratch_folder(repo_root, cwd)
    ran = 0
    for kind, item in page.steps:
        if kind == "file":
            name, text = item  # type: ignore[misc]
            with open(os.path.join(cwd, name), "w", encoding="utf-8") as f:
                f.write(text)
            continue
        command: Command = item  # type: ignore[assignment]
        if command.skip is not None:
            continue
        output = run_command(command, cwd, timeout, env)
        if not matches(command.expected, output, command.numbers):
            shown = "\n".join(command.expected)
            raise AssertionError(
                f"{command.where}: `{COMMAND} {shlex.join(command.argv)}` printed something else than the page "
                f"shows.\n--- the page ---\n{shown}\n--- the command ---\n{normalise(output)}")
        ran += 1
    return ran
