"""Find the ```python blocks of a Markdown page and run them, so the docs cannot drift from the code.

Every ```python block runs, in page order, in one namespace per page (a later block sees what an
earlier one defined). An HTML comment on the line before a block (blank lines between are allowed)
changes how it runs; the comment is invisible on the rendered page:

- ``<!-- snippet: skip: REASON -->``: not run; the reason is required and says why (e.g. it needs a
  ``torchrun`` job, or it is an outline with placeholders).
- ``<!-- snippet: ranks=N -->`` (optionally ``platform=mindspore``): run the block once per rank of a
  ``LocalCluster(N)``, each rank in its own copy of the page namespace. Consecutive blocks with the same
  options share one cluster run, so a block can use what the block before it built on that rank.

Setup code a reader does not need to see (a tiny model for a fragment) goes into a hidden block, an
HTML comment that starts with ``<!-- snippet-setup`` (followed by the same options as above) and
holds Python lines up to ``-->``. It runs like a visible block at its place in the page.

Pages this test may not annotate carry their directives in the test instead (``external``: a unique
substring of the block mapped to the directive text).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")
_SETUP = re.compile(r"^\s*<!--\s*snippet-setup\b(.*)$")


@dataclass
class Block:
    """One runnable (or skipped) block: where it starts, its code and how to run it."""

    path: str
    line: int
    code: str
    hidden: bool = False
    skip: str | None = None
    ranks: int | None = None
    platform: str = "torch"
    options: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}" + (" (hidden setup)" if self.hidden else "")

    def session_key(self) -> tuple | None:
        return None if self.ranks is None else (self.ranks, self.platform)


def _apply(block: Block, directive: str) -> None:
    """Set a block's options from a directive's text (``skip: reason`` or ``ranks=N platform=P``)."""
    text = directive.strip()
    if text.startswith("skip"):
        reason = text[len("skip"):].lstrip(" :").strip()
        if not reason:
            raise ValueError(f"{block.where}: 'snippet: skip' needs a reason, got {directive!r}")
        block.skip = reason
        return
    for word in text.split():
        key, _, value = word.partition("=")
        if key == "ranks" and value.isdigit() and int(value) >= 1:
            block.ranks = int(value)
        elif key == "platform" and value in ("torch", "mindspore"):
            block.platform = value
        else:
            raise ValueError(f"{block.where}: unknown snippet directive {word!r} in {directive!r}")


def parse(text: str, path: str, external: dict[str, str] | None = None) -> list[Block]:
    """The Python blocks of one Markdown text, hidden setup blocks included, in page order."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: str | None = None  # a directive waiting for its block
    i = 0
    while i < len(lines):
        line = lines[i]
        mark, setup, fence = _MARK.match(line), _SETUP.match(line), _FENCE.match(line)
        if mark:
            pending = mark.group(1)
        elif setup:
            head = setup.group(1)
            body: list[str] = []
            if "-->" in head:
                raise ValueError(f"{path}:{i + 1}: a snippet-setup comment holds code on the lines after it")
            i += 1
            while i < len(lines) and lines[i].strip() != "-->":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"{path}: the snippet-setup comment at line {len(lines) - len(body)} never ends")
            block = Block(path, i - len(body) + 1, textwrap.dedent("\n".join(body)) + "\n", hidden=True)
            _apply(block, head)
            blocks.append(block)
        elif fence:
            indent, lang = fence.group(1), fence.group(2)
            start = i
            body = []
            i += 1
            while i < len(lines) and not (_FENCE.match(lines[i]) and _FENCE.match(lines[i]).group(2) == ""):
                body.append(lines[i])
                i += 1
            if lang == "python":
                code = textwrap.dedent("\n".join(body)) + "\n"
                block = Block(path, start + 1, code)
                directive = pending
                for needle, text_ in (external or {}).items():
                    if needle in code:
                        if directive is not None:
                            raise ValueError(f"{block.where}: annotated both in the page and in the test")
                        directive = text_
                if directive is not None:
                    _apply(block, directive)
                blocks.append(block)
            elif pending is not None:
                raise ValueError(f"{path}:{start + 1}: 'snippet: {pending}' stands before a {lang or 'plain'} block")
            pending = None
            del indent
        elif line.strip() and pending is not None:
            raise ValueError(f"{path}:{i + 1}: 'snippet: {pending}' is not followed by a ```python block")
        i += 1
    if pending is not None:
        raise ValueError(f"{path}: 'snippet: {pending}' at the end of the page has no block")
    return blocks


def _exec(block: Block, namespace: dict) -> None:
    try:
        exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102 - running the docs is the point
    except Exception as exc:
        raise AssertionError(f"snippet {block.where} failed: {type(exc).__name__}: {exc}") from exc


def _run_session(blocks: list[Block], namespace: dict) -> None:
    from hyper_parallel.platform.local import LocalCluster

    def rank_main() -> None:
        own = dict(namespace)
        for block in blocks:
            _exec(block, own)

    LocalCluster(blocks[0].ranks, platform=blocks[0].platform).run(rank_main)


def run_blocks(blocks: list[Block]) -> tuple[int, int]:
    """Run the blocks of one page in order; returns (run, skipped). Raises on the first failure."""
    namespace: dict = {"__name__": "__doc_snippet__"}
    ran = skipped = 0
    session: list[Block] = []
    for block in blocks + [None]:  # type: ignore[list-item]
        if session and (block is None or block.skip is None and block.session_key() != session[0].session_key()):
            _run_session(session, namespace)
            session = []
        if block is None:
            break
        if block.skip is not None:
            skipped += 1
            continue
        ran += 1
        if block.ranks is None:
            _exec(block, namespace)
        else:
            session.append(block)
    return ran, skipped
