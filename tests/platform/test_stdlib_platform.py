"""The repository's top-level platform/ folder must never shadow the standard library module."""

import os
import subprocess
import sys

from conftest import REPO_ROOT


def test_import_platform_from_repo_root_is_stdlib():
    code = "import platform, sys; print(platform.__file__); print(platform.python_version())"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert not out[0].startswith(REPO_ROOT + os.sep), out[0]
    assert out[1] == ".".join(str(v) for v in sys.version_info[:3])
    assert os.path.isdir(os.path.join(REPO_ROOT, "platform", "cpu"))
