"""Opening the files the library reads and writes (the tuning table, its lock, timelines) so
that a hostile path cannot hang or redirect it: nothing but a regular file is read or written,
no open blocks (a FIFO), a symbolic link in the last component is not followed where the
library writes (a planted link must not truncate another file), and created files are private
(mode 0600)."""
from __future__ import annotations

import os
import stat

_FLAGS = os.O_NONBLOCK | os.O_CLOEXEC     # O_NONBLOCK: opening a FIFO never waits for a peer


def _regular(fd: int, path: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(f"{path}: not a regular file")
    return st


def read_regular(path: str, limit: int) -> bytes:
    """The contents of the regular file `path` (a link to one is followed), at most `limit`
    bytes; OSError for anything else (a FIFO, a device, a directory, a larger file), never a
    blocking open."""
    fd = os.open(path, os.O_RDONLY | _FLAGS)
    st = _regular(fd, path)
    try:
        if st.st_size > limit:
            raise OSError(f"{path}: {st.st_size} bytes, more than the {limit} accepted")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise OSError(f"{path}: grew beyond the {limit} bytes accepted while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_private(path: str, truncate: bool = True) -> int:
    """An fd open for writing on the regular file `path`, created with mode 0600 if missing
    (truncated if `truncate`); OSError if the last component is a symbolic link or the file is
    not a regular one."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | _FLAGS
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        if os.path.islink(path):
            raise OSError(e.errno, f"{path} is a symbolic link: not followed for writing") from None
        raise
    _regular(fd, path)
    if truncate:
        os.ftruncate(fd, 0)
    return fd
