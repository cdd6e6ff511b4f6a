"""Files replaced whole: the new content goes to a temporary beside the file, which takes the file's place only
once it is complete, so that a reader (or a process killed mid-write) finds the old file or the new, never a
part. Standard library only: every layer that writes a file it may be killed writing uses it."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def replacing(path: Path | str, sync: bool = True) -> Iterator[BinaryIO]:
    """A binary file for the new content of ``path``: a temporary in the same folder (created with it) that
    replaces ``path`` when the block ends, flushed and, with ``sync``, synced to disk first. Any error leaves the
    previous file (or none) and no temporary, and is raised as it came."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temp, "xb") as out:
            yield out
            out.flush()
            if sync:
                os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path | str, data: bytes | str) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` through ``replacing``: the old file or the new, never a part."""
    with replacing(path) as out:
        out.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)
