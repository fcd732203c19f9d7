"""Writing state files so that a crash never leaves half of one."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> Path:
    """Write a temporary file beside ``path``, fsync it, rename it over ``path``: a reader
    sees the old file or the new one, never half (parents are created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
    return path
