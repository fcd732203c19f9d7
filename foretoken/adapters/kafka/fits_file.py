"""``fits.snapshot``: the processor's fits (their sample windows) and the answer lengths it
learned (:class:`~foretoken.core.routing.outputs.OutputLengths`) on disk, so a restarted
processor predicts with what it had learned instead of the defaults."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from foretoken.adapters.files import write_atomically
from foretoken.core.cost.registry import FitRegistry
from foretoken.core.routing.outputs import OutputLengths
from foretoken.settings import Settings

log = logging.getLogger(__name__)


class _FitsFile(msgspec.Struct, frozen=True):
    """The fits and whose they are (the ``graded`` topic they learned from), so that a data
    directory reused with other topics never lends its fits."""

    scope: str
    fits: bytes
    outputs: bytes = b""  # OutputLengths.state() (absent in older files: learned afresh)


def fits_path(settings: Settings) -> Path:
    return settings.snapshot_path / "fits.snapshot"


def fits_bytes(
    settings: Settings, fits: FitRegistry, outputs: OutputLengths | None = None
) -> bytes:
    """The snapshot's bytes (taken on the event loop; writing them may go elsewhere)."""
    learned = outputs.state() if outputs is not None else b""
    return msgspec.msgpack.encode(_FitsFile(settings.topic("graded"), fits.snapshot(), learned))


def save_fits(settings: Settings, fits: FitRegistry, outputs: OutputLengths | None = None) -> Path:
    return write_atomically(fits_path(settings), fits_bytes(settings, fits, outputs))


def load_fits(settings: Settings, fits: FitRegistry, outputs: OutputLengths | None = None) -> bool:
    """Restore the fits saved by :func:`save_fits`; a missing or unreadable file means
    learning afresh (from the defaults), never a crash."""
    path = fits_path(settings)
    if not path.exists():
        return False
    try:
        saved = msgspec.msgpack.decode(path.read_bytes(), type=_FitsFile)
        if saved.scope != settings.topic("graded"):
            raise ValueError(f"fits learned from {saved.scope}")
        fits.restore(saved.fits)
        if outputs is not None and saved.outputs:
            outputs.load_state(saved.outputs)
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        log.warning("ignoring fits snapshot %s (%s): learning afresh", path, exc)
        return False
    return True
