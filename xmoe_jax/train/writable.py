"""Whether a folder can take a file: the one test a read-only mount cannot pass.

A leaf (it imports nothing of xmoe_jax): the run directory's checks (`runlock.check_writable`) and
every checkpoint save (`Checkpointer.save`, which must fail in milliseconds rather than inside
orbax's thread) both ask it.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path


def probe_write(directory: Path) -> None:
    """Creates and removes a file in `directory` (`os.access` says yes to root on a read-only
    mount). Raises the `OSError`."""
    probe = directory / f".write-test.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"
    os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    os.unlink(probe)
