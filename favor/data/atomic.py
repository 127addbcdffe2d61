"""Files that several writers may produce at once (hosts sharing a data_dir, a rerun beside a killed
run): each is written under a temporary name of its writer's own and renamed into place, so a reader
finds the whole file or none, and two writers never write into one temporary file."""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from pathlib import Path


def unique_tag() -> str:
    """host-pid-random: distinct across hosts on a shared disk (host), processes (pid) and a pid reused
    after a restart or in a container (the random part)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def copy_file(src, dst) -> None:
    """Copy `src` to `dst` through a temporary name of this writer's own, renamed into place."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.tmp-{unique_tag()}")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def write_text(dst, text: str) -> None:
    """Write `text` to `dst` through a temporary name of this writer's own, renamed into place."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.tmp-{unique_tag()}")
    tmp.write_text(text)
    os.replace(tmp, dst)
