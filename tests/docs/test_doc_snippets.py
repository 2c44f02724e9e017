"""Every ```python block of README.md and docs/*.md runs (see doc_snippets.py for the markers)."""

from __future__ import annotations

import glob
import os

import pytest
from conftest import REPO_ROOT
from doc_snippets import parse, run_blocks

# Pages this test may not edit carry their directives here: a unique substring of the block -> directive.
EXTERNAL = {
    "docs/zero_bubble.md": {
        "coordinator = HookCoordinator()": "skip: an outline of two threads' calls (one per side, `...` "
        "stands for their work); tests/pipeline/test_pp_comm_compute_overlap.py runs the real thing",
        "dispatch = overlap.wrap_dispatch(ep_dispatch)": "skip: the inside of a runtime step handler (needs the expert "
        "all-to-alls and a stage's records); tests/pipeline/test_pp_comm_compute_overlap.py runs it",
    },
}

PAGES = sorted(
    os.path.relpath(p, REPO_ROOT)
    for p in [os.path.join(REPO_ROOT, "README.md"), *glob.glob(os.path.join(REPO_ROOT, "docs", "*.md"))]
)


def _blocks(page: str):
    with open(os.path.join(REPO_ROOT, page), encoding="utf-8") as f:
        return parse(f.read(), page, EXTERNAL.get(page))


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)])
def test_page_snippets_run(page, monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", "torch")
    blocks = _blocks(page)
    if any(b.platform == "mindspore" and b.skip is None for b in blocks):
        pytest.importorskip("mindspore")
    ran, skipped = run_blocks(blocks)
    assert ran == sum(b.skip is None for b in blocks) and ran + skipped == len(blocks)


def test_every_page_with_code_is_collected():
    # a page whose python fences the parser missed would silently run nothing
    for page in PAGES:
        with open(os.path.join(REPO_ROOT, page), encoding="utf-8") as f:
            fences = sum(1 for line in f if line.strip() == "```python")
        visible = [b for b in _blocks(page) if not b.hidden]
        assert len(visible) == fences, page


def test_external_directives_match_a_block():
    for page, directives in EXTERNAL.items():
        blocks = _blocks(page)
        for needle in directives:
            assert sum(needle in b.code for b in blocks) == 1, (page, needle)


def test_markers_and_failures_are_reported():
    text = (
        "<!-- snippet: skip: needs torchrun -->\n```python\nraise SystemExit\n```\n"
        "<!-- snippet-setup ranks=2\nfrom hyper_parallel import get_platform\n-->\n"
        "<!-- snippet: ranks=2 -->\n\n```python\nRANK = get_platform().rank\n```\n"
        "```python\nvalue = 1\n```\n```python\nassert value == 2\n```\n"
    )
    blocks = parse(text, "page.md")
    assert [(b.line, b.hidden, b.skip is not None, b.ranks) for b in blocks] == [
        (2, False, True, None), (6, True, False, 2), (10, False, False, 2), (13, False, False, None),
        (16, False, False, None),
    ]
    with pytest.raises(AssertionError, match=r"snippet page.md:16 failed: AssertionError"):
        run_blocks(blocks)
    with pytest.raises(ValueError, match="needs a reason"):
        parse("<!-- snippet: skip -->\n```python\npass\n```\n", "p.md")
    with pytest.raises(ValueError, match="unknown snippet directive 'rank=2'"):
        parse("<!-- snippet: rank=2 -->\n```python\npass\n```\n", "p.md")
    with pytest.raises(ValueError, match="not followed by a ```python block"):
        parse("<!-- snippet: ranks=2 -->\ntext\n```python\npass\n```\n", "p.md")
