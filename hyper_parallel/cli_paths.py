"""argparse ``type``s for the files the ``hyper-parallel`` subcommands write: a path that cannot be
written fails as a usage error (one ``error:`` line, exit code 2) while the arguments are parsed,
before any work starts."""

from __future__ import annotations

import argparse
import errno
import importlib.util
import os

PICTURE_EXTENSIONS = (".png", ".svg")


def output_path(text: str) -> str:
    """``text`` (with ``~`` expanded) when a file can be written there: its folder exists and is
    a folder, the path itself is not a folder nor a read-only file, and when no file is there yet
    one can be created under that very name (probed, removed at once)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a file path, got an empty string")
    if text.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: a file name cannot end with {text[-1]!r}")
    text = os.path.expanduser(text)  # what is checked is what gets written (a quoted ~ too)
    # the path as the file system will resolve it when writing (not abspath's: "missing/../x" is
    # no file); a link to a file not written yet is checked where it points
    target = os.path.realpath(text) if os.path.islink(text) else text
    if os.path.isdir(target):
        raise argparse.ArgumentTypeError(f"cannot write {text}: it is a folder")
    folder = os.path.dirname(target) or os.curdir
    shown = folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)  # not normalized: ".." kept
    if not os.path.exists(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text}: folder {shown} does not exist")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {shown} is not a folder")
    if os.path.exists(target):
        if not os.access(target, os.W_OK):
            raise argparse.ArgumentTypeError(f"cannot write {text}: the file is read-only")
        return text
    try:  # the very name, so that one no file can have (too long, say) fails here
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        why = (f"folder {shown} is not writable" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT)
               else "no file can have this name")
        raise argparse.ArgumentTypeError(f"cannot write {text}: {why} ({exc.strerror or exc})") from None
    os.close(fd)
    os.remove(target)
    return text


def picture_path(text: str) -> str:
    """An `output_path` ending in ``.png`` or ``.svg``, with matplotlib installed to draw it."""
    if os.path.splitext(text)[1].lower() not in PICTURE_EXTENSIONS:
        raise argparse.ArgumentTypeError(f"cannot tell the picture format of {text!r}: use a .png or .svg name")
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("PNG/SVG charts need matplotlib, which is not installed; install it "
                                         "with pip install 'hyper-parallel[viz]'")
    return output_path(text)
