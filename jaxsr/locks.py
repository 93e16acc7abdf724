"""An exclusive lock on an output path, so that one process at a time writes it.

The lock is a file beside the output (`x.jsonl.lock`), taken with `flock` and naming its holder (pid,
host, start time); a second process asking for it is refused at once, naming the holder. The operating
system releases the lock when the process dies, so a killed writer's output can be taken up again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path


def lock_path(output: Path) -> Path:
    """The lock file of an output: `out/x.jsonl` -> `out/x.jsonl.lock`."""
    return output.with_name(output.name + ".lock")


MIN_FREE_BYTES = 2**20
"""Less room than this where an output goes is a full disk: refused before any model loads."""


def _check_room(directory: Path) -> None:
    """Refuse a directory (or, not made yet, its nearest existing parent) on a full filesystem."""
    existing = next((p for p in (directory, *directory.parents) if p.exists()), Path("/"))
    try:
        stat = os.statvfs(existing)
    except OSError:  # not a place statvfs can read: creating the lock below names the problem
        return
    free = stat.f_bavail * stat.f_frsize
    if free < MIN_FREE_BYTES:
        raise ValueError(
            f"output: {existing} has {free // 1024} KiB free (its disk is full); free some space or "
            "choose another output"
        )


@contextlib.contextmanager
def holding(output: Path, beside: Sequence[Path] = ()) -> Iterator[None]:
    """Hold the exclusive lock of `output` for the block (see the module docstring). Refuses with a
    ValueError naming the holder when another process holds it, or naming the path when the output (or
    a file written `beside` it) cannot be written there."""
    for path in (output, *beside):
        if path.is_dir():
            raise ValueError(f"output: {path} is a directory; give a .jsonl file path")
        if path.exists() and not path.is_file():  # a FIFO, a device (a link to one)
            raise ValueError(f"output: {path} is not a regular file")
    _check_room(output.parent)
    path = lock_path(output)
    created = [p for p in (output.parent, *output.parent.parents) if not p.exists()]
    while True:
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ValueError(f"output: cannot write beside {output} ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ValueError(
                f"output: {output} is being written by another job ({holder}); wait for it to end or "
                "choose another output"
            ) from None
        try:  # the holder before us may have removed the file after we opened it: lock the new one
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(
                fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%F %T')}".encode()
            )
        except OSError as e:  # a full disk takes the file's name but not its first line
            raise ValueError(f"output: cannot write the lock file {path} ({e.strerror})") from None
        yield
    finally:
        path.unlink(missing_ok=True)  # while still holding it, so no one locks a file about to vanish
        os.close(fd)
        for directory in created:  # folders made for an output that was never written go again
            with contextlib.suppress(OSError):
                directory.rmdir()
