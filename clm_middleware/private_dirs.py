"""Folders this library creates for what it stores (conversations, caches, verdicts):
owner-only, every one of them.

``Path.mkdir(parents=True, mode=0o700)`` gives the mode to the last folder only; the
parents it creates get the umask's default (often 0755), so ``--db new/sub/chats.db``
left ``new`` readable by others.
"""

from __future__ import annotations

import os
from pathlib import Path


def make_private_dirs(folder: Path) -> None:
    """Create ``folder`` and any missing parent, each 0700; folders that exist are left as
    they are. Raises ``OSError`` as ``mkdir`` does."""
    created = [path for path in (folder, *folder.parents) if not path.exists()]
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for path in created:
        os.chmod(path, 0o700)
