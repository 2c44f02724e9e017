"""Every ``$ hyper-parallel ...`` block of README.md and docs/*.md prints what the page shows
(see doc_commands.py for how output compares and for the markers)."""

from __future__ import annotations

import glob
import os

import pytest
from conftest import REPO_ROOT
from doc_commands import Command, matches, parse, run_page

PAGES = sorted(
    os.path.relpath(p, REPO_ROOT)
    for p in [os.path.join(REPO_ROOT, "README.md"), *glob.glob(os.path.join(REPO_ROOT, "docs", "*.md"))]
)
TIMEOUT = 240  # seconds per command: the slowest (profile, dryrun) take a few seconds on an idle machine


def _page(path: str):
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
        return parse(f.read(), path)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", [p for p in PAGES if _page(p).commands])
def test_page_commands_print_what_the_page_shows(path, tmp_path):
    page = _page(path)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    ran = run_page(page, REPO_ROOT, str(tmp_path), TIMEOUT, env)
    assert ran == sum(c.skip is None for c in page.commands)


def test_every_prompt_line_is_collected():
    # a `$ hyper-parallel` line the parser missed would silently check nothing
    for path in PAGES:
        with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
            prompts = sum(1 for line in f if line.lstrip().startswith("$ hyper-parallel"))
        assert len(_page(path).commands) == prompts, path


def test_skips_are_rare_and_give_a_reason():
    commands = [c for p in PAGES for c in _page(p).commands]
    skipped = [c for c in commands if c.skip is not None]
    assert all(c.skip for c in skipped)
    assert len(skipped) * 4 <= len(commands), [c.where for c in skipped]


def test_output_comparison_is_strict_outside_the_marked_places():
    shown = ["makespan 15, bubble 20.0%", "", "wrote dry.json"]
    assert matches(shown, "makespan 15, bubble 20.0%   \n\nwrote dry.json\n\n")
    assert not matches(shown, "makespan 16, bubble 20.0%\n\nwrote dry.json\n")
    assert not matches(shown, "makespan 15, bubble 20.0%\n\nwrote dry.json\nan extra line\n")
    assert not matches(shown, "makespan 15, bubble 20.0%\nwrote dry.json\n")
    # `...` alone: any lines, none included; a line ending in ` ...`: its start, then any lines
    assert matches(["a", "...", "b"], "a\nb\n") and matches(["a", "...", "b"], "a\nx\ny\nb\n")
    assert not matches(["a", "...", "b"], "a\nx\nc\n")
    usage = ["usage: hyper-parallel profile [-h] ...", "hyper-parallel profile: error: no"]
    assert matches(usage, "usage: hyper-parallel profile [-h] [--stages N]\n      [--json]\nhyper-parallel profile: "
                          "error: no\n")
    assert not matches(usage, "usage: hyper-parallel simulate [-h]\nhyper-parallel profile: error: no\n")
    assert not matches(usage, "usage: hyper-parallel profile [-h]\nhyper-parallel profile: error: yes\n")
    # numbers: any number and any run of spaces, the words still count
    table = ["stage      F ms  spread", "    0   0.03917     15%"]
    assert matches(table, "stage      F ms  spread\n    0     1.2      7%\n", numbers=True)
    assert not matches(table, "stage      F ms  spread\n    0     1.2      7%\n")
    assert not matches(table, "stage      B ms  spread\n    0     1.2      7%\n", numbers=True)


def test_markers_are_parsed_and_checked():
    text = (
        "<!-- command-file: bad.json\n{\"stages\": []}\n-->\n"
        "<!-- command-file: costs.json -->\n```json\n{}\n```\n"
        "<!-- command: numbers -->\n\n```\n$ hyper-parallel simulate --costs 'costs.json'\nout 1\n\n"
        "$ hyper-parallel chart\nchart\n```\n"
        "<!-- command: skip: needs a GPU -->\n```\n$ hyper-parallel demo\n```\n"
        "```\nhyper-parallel chart   (a usage line: no prompt, not run)\n```\n"
    )
    page = parse(text, "page.md")
    assert [(kind, item) for kind, item in page.steps if kind == "file"] == [
        ("file", ("bad.json", '{"stages": []}\n')), ("file", ("costs.json", "{}\n"))]
    assert [(c.line, c.argv, c.expected, c.numbers, c.skip) for c in page.commands] == [
        (11, ["simulate", "--costs", "costs.json"], ["out 1"], True, None),
        (14, ["chart"], ["chart"], True, None),
        (19, ["demo"], [], False, "needs a GPU"),
    ]
    assert isinstance(page.commands[0], Command) and page.commands[0].where == "page.md:11"
    with pytest.raises(ValueError, match="needs a reason"):
        parse("<!-- command: skip -->\n```\n$ hyper-parallel chart\n```\n", "p.md")
    with pytest.raises(ValueError, match="unknown command directive"):
        parse("<!-- command: number -->\n```\n$ hyper-parallel chart\n```\n", "p.md")
    with pytest.raises(ValueError, match="runs only"):
        parse("```\n$ hyper-parallel chart\n$ ls\n```\n", "p.md")
    with pytest.raises(ValueError, match="starts with its"):
        parse("```\noutput first\n$ hyper-parallel chart\n```\n", "p.md")
    with pytest.raises(ValueError, match="without a `\\$ hyper-parallel` line"):
        parse("<!-- command: numbers -->\n```\nplain\n```\n", "p.md")
    with pytest.raises(ValueError, match="not followed by a fenced block"):
        parse("<!-- command-file: x.json -->\ntext\n```\n{}\n```\n", "p.md")


def test_a_changed_message_fails(tmp_path):
    page = parse("```\n$ hyper-parallel chart --schedule gpipe --ranks 2 --micro-batches 1\nno such output\n```\n",
                 "p.md")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    with pytest.raises(AssertionError, match=r"(?s)p.md:2: `hyper-parallel chart --schedule gpipe.*--- the command ---\n"
                                             r"ScheduleGPipe: 2 ranks"):
        run_page(page, REPO_ROOT, str(tmp_path), TIMEOUT, env)
