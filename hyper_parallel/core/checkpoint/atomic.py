"""A checkpoint folder appears whole or not at all, and is checked whole before anything is read from it.

Saving writes into a temporary folder beside the target (``.<name>.saving-<id>``), agreed on by every
rank; each rank flushes (``fsync``) and checksums its share of the written files; rank 0 then writes
the commit marker (``COMMITTED.json``: the layout, the platform, the rank count, every file's size and
CRC-32) and puts the folder in place in one rename (an existing checkpoint is exchanged with it
atomically where the file system can, ``renameat2(RENAME_EXCHANGE)``, else renamed aside just before)
and deletes the previous one. Every step ends with all ranks agreeing that it worked: a failure on any
rank raises :class:`CheckpointError` on every rank, the temporary folder is removed and the target is
left as it was. The folder must be on a file system every rank sees (as torch.distributed.checkpoint
needs anyway). No framework import.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import time
import uuid
import warnings
import zlib
from typing import Any

from hyper_parallel.platform.checkpoint_common import CheckpointError, agree

MARKER = "COMMITTED.json"
LATEST = "latest"
FORMAT = 1
_CHUNK = 1 << 22


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), b)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: str, flush: bool = False) -> tuple[int, int]:
    """``(size, CRC-32)`` of a file; with ``flush`` its data is forced to disk first."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        if flush:
            os.fsync(f.fileno())
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def _listing(folder: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, f), folder) for f in files]
    return sorted(out)


def _check_target(path: str) -> None:
    if os.path.lexists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{path!r} exists and is not a folder")
    if os.path.isdir(path) and os.listdir(path) and not os.path.exists(os.path.join(path, MARKER)):
        raise FileExistsError(f"{path!r} is a folder that holds no complete checkpoint (no {MARKER}); "
                              "it is not replaced: remove it or save elsewhere")


def resolve(path: str) -> str:
    """The folder a save replaces: the target of ``path`` when it is a symbolic link (the link stays and
    the temporary folder is made beside the real one, on its file system), else ``path``."""
    return os.path.realpath(path) if os.path.islink(path) else path


def begin(platform: Any, path: str, local_error: BaseException | None) -> str:
    """Rank 0 makes the temporary folder; returns its name on every rank (after every rank reported
    ``local_error``, a failure found before writing)."""
    error, folder = local_error, None
    if platform.rank == 0 and error is None:
        try:
            _check_target(path)
            parent, name = os.path.split(os.path.abspath(path))
            os.makedirs(parent, exist_ok=True)
            folder = os.path.join(parent, f".{name}.saving-{uuid.uuid4().hex[:12]}")
            os.mkdir(folder)
        except OSError as exc:
            error = exc
    try:
        return agree(platform, "save", path, error, where="before writing", payload=folder)[0]
    except CheckpointError:
        abandon(platform, folder)
        raise


def seal(platform: Any, path: str, folder: str, write_error: BaseException | None, layout: str,
         keep: int | None = None) -> None:
    """After every rank wrote into ``folder``: flush and checksum the files, write the marker, put the
    folder in place (then, with ``keep``, point ``latest`` at it and prune, see :func:`_rotate`).
    Raises :class:`CheckpointError` on every rank if any step failed on any rank."""
    agree(platform, "save", path, write_error, where=f"writing into {folder!r}")
    error, digests = None, {}
    try:
        files = _listing(folder)
        for i, name in enumerate(files):
            if i % platform.world_size == platform.rank:
                digests[name] = file_digest(os.path.join(folder, name), flush=True)
    except OSError as exc:
        error = exc
    everyone = agree(platform, "save", path, error, where=f"flushing the files of {folder!r}", payload=digests)
    error = None
    if platform.rank == 0:
        try:
            marker = {"format": FORMAT, "layout": layout, "platform": platform.name,
                      "world_size": platform.world_size, "saved_at": time.time(),
                      "files": {k: list(v) for d in everyone for k, v in sorted(d.items())}}
            _commit(folder, path, marker)
        except OSError as exc:
            error = exc
    agree(platform, "save", path, error, where=f"committing {folder!r}")
    if keep is not None:
        if platform.rank == 0:
            _rotate(path, keep)
        platform.barrier()  # no rank returns before ``latest`` names the new checkpoint


def committed_siblings(parent: str) -> list[tuple[float, str]]:
    """``(saved_at, path)`` of every complete checkpoint folder directly in ``parent``, oldest first."""
    out = []
    for name in os.listdir(parent):
        full = os.path.join(parent, name)
        if name.startswith(".") or not os.path.isfile(os.path.join(full, MARKER)):
            continue
        try:
            with open(os.path.join(full, MARKER)) as f:
                out.append((float(json.load(f)["saved_at"]), full))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not one of ours, or unreadable: never pruned
    return sorted(out)


def _rotate(path: str, keep: int) -> None:
    """After a commit: write ``latest`` (the folder's name) beside it atomically, and delete all but the
    ``keep`` newest complete checkpoints there. The checkpoint is saved either way: a failure here warns."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        pointer = os.path.join(parent, f".{LATEST}.{uuid.uuid4().hex[:12]}")
        with open(pointer, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, os.path.join(parent, LATEST))
        _fsync_dir(parent)
        for _, old in committed_siblings(parent)[:-keep]:
            if os.path.abspath(old) != os.path.abspath(path):
                os.remove(os.path.join(old, MARKER))  # first: a half-deleted folder is no checkpoint
                shutil.rmtree(old)
    except OSError as exc:
        warnings.warn(f"checkpoint {path!r} is saved, but updating {LATEST!r} or removing older checkpoints "
                      f"failed: {exc}", stacklevel=3)


def latest(parent: str) -> str | None:
    """The newest complete checkpoint in ``parent``: the one ``latest`` names if it is complete, else the
    newest by commit time; ``None`` when there is none."""
    try:
        with open(os.path.join(parent, LATEST)) as f:
            named = os.path.join(parent, f.read().strip())
        if os.path.isfile(os.path.join(named, MARKER)):
            return named
    except OSError:
        pass
    found = committed_siblings(parent) if os.path.isdir(parent) else []
    return found[-1][1] if found else None


def _commit(folder: str, path: str, marker: dict) -> None:
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(folder)
    _check_target(path)
    old = None
    if not os.path.lexists(path):
        os.rename(folder, path)
    elif _exchange(folder, path):
        old = folder
    else:
        old = folder + ".old"
        os.rename(path, old)
        try:
            os.rename(folder, path)
        except OSError:
            os.rename(old, path)
            raise
    # the new checkpoint is in place: from here on a failure must not report the save as not done
    try:
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        warnings.warn(f"checkpoint {path!r} is in place, but flushing its parent folder failed (after a crash "
                      f"the previous checkpoint may be back): {exc}", stacklevel=2)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def abandon(platform: Any, folder: str | None) -> None:
    """Remove the temporary folder of a failed save (rank 0, after every rank stopped writing)."""
    if platform.rank == 0 and folder:
        shutil.rmtree(folder, ignore_errors=True)


def read_marker(path: str) -> dict:
    if not os.path.isdir(path):
        parent, name = os.path.split(os.path.abspath(path))
        left = sorted(f for f in (os.listdir(parent) if os.path.isdir(parent) else [])
                      if f.startswith(f".{name}.saving-") and os.path.isfile(os.path.join(parent, f, MARKER)))
        hint = (f"; a save interrupted while putting it in place left the complete folders {left} in "
                f"{parent!r} (the newest without '.old' is the new checkpoint): rename one to {name!r}") if left else ""
        raise FileNotFoundError(f"no checkpoint at {path!r}{hint}")
    marker_file = os.path.join(path, MARKER)
    if not os.path.exists(marker_file):
        raise FileNotFoundError(f"{path!r} has no commit marker {MARKER}: the save that wrote it did not finish, "
                                "or save_checkpoint did not write it")
    with open(marker_file) as f:
        return json.load(f)


def verify(platform: Any, path: str, layout: str, checksums: bool = True) -> dict:
    """Check the folder against its marker on every rank (presence and size of every file, this rank's
    share of the checksums, the layout, the platform, the rank count of a per-rank layout); every rank
    raises the same :class:`CheckpointError` when any check failed anywhere. Returns the marker."""
    error, marker = None, {}
    try:
        marker = read_marker(path)
        if marker.get("format") != FORMAT or marker.get("platform") != platform.name:
            raise ValueError(f"{path!r} was written by the {marker.get('platform')!r} platform (format "
                             f"{marker.get('format')}), this job runs {platform.name!r} (format {FORMAT})")
        if marker.get("layout") != layout:
            raise ValueError(f"{path!r} holds a {marker.get('layout')!r} checkpoint, this job reads {layout!r}")
        if layout.endswith("per-rank files") and marker.get("world_size") != platform.world_size:
            raise ValueError(f"{path!r} was saved by {marker.get('world_size')} ranks, this job has "
                             f"{platform.world_size} (per-rank files load only on the same split)")
        for i, (name, (size, crc)) in enumerate(sorted(marker["files"].items())):
            file = os.path.join(path, name)
            if not os.path.exists(file):
                raise FileNotFoundError(f"the file {file!r} of the checkpoint is missing")
            if os.path.getsize(file) != size:
                raise ValueError(f"the file {file!r} has {os.path.getsize(file)} bytes, {size} were saved "
                                 "(truncated or replaced)")
            if checksums and i % platform.world_size == platform.rank and file_digest(file)[1] != crc:
                raise ValueError(f"the file {file!r} does not hold what was saved (CRC-32 differs): "
                                 "corrupted, or a file of another checkpoint")
    except Exception as exc:  # noqa: BLE001 - a marker of another shape too: every rank learns of it
        error = exc
    agree(platform, "load", path, error, where="checking the files")
    return marker


__all__ = ["CheckpointError", "MARKER", "abandon", "begin", "read_marker", "seal", "verify"]
