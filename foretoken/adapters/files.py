"""Writing state files so that a crash never leaves half of one."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

# One write at a time per process: the snapshot timer writes in an executor thread and the
# shutdown hook on the event loop; they used to share one temporary name, and the second
# rename found nothing (FileNotFoundError in the shutdown hook: the worker hung on SIGTERM).
_WRITING = threading.Lock()


def write_atomically(path: Path, data: bytes) -> Path:
    """Write a temporary file beside ``path`` (a name of its own), fsync it, rename it over
    ``path``: a reader sees the old file or the new one, never half (parents are created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    with _WRITING:
        try:
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.rename(path)
        finally:
            tmp.unlink(missing_ok=True)
    return path
