"""The documentation site builds in strict mode (what `make docs` runs): a broken link, a page
missing from the nav or an API reference that cannot be collected fails it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

pytest.importorskip("mkdocstrings_handlers.python", reason="the docs packages (platform/cpu/requirements.txt)")
pytest.importorskip("material", reason="the docs packages (platform/cpu/requirements.txt)")


def test_site_builds_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=REPO_ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", os.path.join(REPO_ROOT, "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    assert "micro_batch_num" in api and "split_layers" in api  # the reference was generated from docstrings
