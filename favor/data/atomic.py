"""Files that several writers may produce at once (hosts sharing a data_dir, a rerun beside a killed
run): each is written under a temporary name of its writer's own and renamed into place, so a reader
finds the whole file or none, and two writers never write into one temporary file."""

from __future__ import annotations

import os
import socket
import uuid


def unique_tag() -> str:
    """host-pid-random: distinct across hosts on a shared disk (host), processes (pid) and a pid reused
    after a restart or in a container (the random part)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
