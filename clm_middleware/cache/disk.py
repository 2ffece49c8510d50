"""The disk tier: blocks evicted from memory spill to disk; a memory miss looks there next.

One safetensors file per block, named by its key, holding K and V plus metadata: the
key, the parent key, the token ids, the model fingerprint and an xxh3 checksum of the
tensor bytes. Invariants:

- Writes are atomic: a temporary file in the same folder, fsync, rename. A reader
  never sees half a block.
- A file is used only if everything in it checks out (key, fingerprint, parent,
  tokens, shapes, checksum). A zero-byte, truncated or mismatched file is a miss: it
  is deleted and counted in ``corrupt``, never used.
- Writes are skipped, with a warning, when free space would fall under
  ``min_free_disk_mb``; a size cap evicts the least recently used files.
- Folders are created 0700 and files 0600: blocks encode users' conversations.
- The tier is an optimisation: no disk fault reaches a caller. A directory that cannot
  be created or written disables the tier with one warning (``enabled`` False); a
  write that fails (ENOSPC, EROFS, EACCES, EIO, out of inodes) is skipped and counted
  in ``errors``, and so is a read that fails (a directory at a key's path, EIO); each
  kind is logged once per tier.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from clm_middleware.cache.hashing import BlockKey
from clm_middleware.errors import ConfigError
from clm_middleware.private_dirs import make_private_dirs

FORMAT = "clm-kv-block/1"
DEFAULT_MIN_FREE_DISK_MB = 512


@dataclass(slots=True)
class DiskStats:
    hits: int = 0
    writes: int = 0
    skipped_writes: int = 0
    corrupt: int = 0
    evicted_files: int = 0
    errors: int = 0  # reads and writes that failed with an OS error (skipped)

    def as_dict(self) -> dict[str, int]:
        return {
            "disk_hits": self.hits,
            "disk_writes": self.writes,
            "disk_skipped_writes": self.skipped_writes,
            "disk_corrupt": self.corrupt,
            "disk_evicted_files": self.evicted_files,
            "disk_errors": self.errors,
        }


class DiskTier:
    def __init__(
        self,
        directory: str | Path,
        fingerprint: str,
        *,
        min_free_disk_mb: int = DEFAULT_MIN_FREE_DISK_MB,
        max_bytes: int | None = None,
    ) -> None:
        if min_free_disk_mb < 0:
            raise ConfigError("min_free_disk_mb", f"must be ≥ 0, got {min_free_disk_mb}")
        if max_bytes is not None and max_bytes < 1:
            raise ConfigError("max_disk_bytes", f"must be ≥ 1, got {max_bytes}")
        self.directory = Path(directory).expanduser() / fingerprint[:32]
        self.fingerprint = fingerprint
        self.min_free_bytes = min_free_disk_mb * 2**20
        self.max_bytes = max_bytes
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self.enabled = True
        try:
            make_private_dirs(self.directory)
            os.chmod(self.directory, 0o700)  # one that existed too: it holds the cache's entries
            probe = self.directory / f".probe.{os.getpid()}.{threading.get_ident()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            self.enabled = False
            self._warn_once("disabled", f"disk cache {self.directory} is not usable ({error}); the disk tier is off")

    def path(self, key: BlockKey) -> Path:
        return self.directory / f"{key:016x}.safetensors"

    # ---------------------------------------------------------------- write

    def write(
        self, key: BlockKey, parent: BlockKey | None, token_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor
    ) -> bool:
        """Store one block; False when skipped: no space, a disk fault, or already there."""
        if not self.enabled:
            return False
        try:
            return self._write(key, parent, token_ids, keys, values)
        except OSError as error:
            with self._lock:
                self.stats.errors += 1
            self._warn_once("write", f"disk cache {self.directory}: a write failed ({error}); skipping it")
            return False

    def _write(
        self, key: BlockKey, parent: BlockKey | None, token_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor
    ) -> bool:
        target = self.path(key)
        if target.exists():
            return False
        tensors = {"keys": keys.detach().to("cpu").contiguous(), "values": values.detach().to("cpu").contiguous()}
        metadata = {
            "format": FORMAT,
            "key": str(key),
            "parent": "" if parent is None else str(parent),
            "token_ids": json.dumps(list(token_ids)),
            "fingerprint": self.fingerprint,
            "checksum": _checksum(tensors),
        }
        payload = save_tensors(tensors, metadata=metadata)
        if shutil.disk_usage(self.directory).free - len(payload) < self.min_free_bytes:
            with self._lock:
                self.stats.skipped_writes += 1
            self._warn_once(
                "space",
                f"disk cache {self.directory}: less than {self.min_free_bytes // 2**20} MB would be free; "
                "skipping writes (raise min_free_disk_mb or free space)",
            )
            return False
        temporary = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        descriptor = os.open(temporary, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        with self._lock:
            self.stats.writes += 1
        if self.max_bytes is not None:
            self._enforce_cap()
        return True

    # ----------------------------------------------------------------- read

    def read(
        self,
        key: BlockKey,
        parent: BlockKey | None,
        token_ids: Sequence[int],
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The block's K/V if a valid file holds it; a bad file is deleted and counted."""
        if not self.enabled:
            return None
        target = self.path(key)
        try:
            payload = target.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:  # a directory at the path, EIO, EACCES: a miss, never a crash
            with self._lock:
                self.stats.errors += 1
            self._warn_once("read", f"disk cache {self.directory}: a read failed ({error}); treating it as a miss")
            return None
        tensors = self._verified(payload, key, parent, token_ids, shape, dtype)
        if tensors is None:
            with contextlib.suppress(OSError):
                target.unlink(missing_ok=True)
            with self._lock:
                self.stats.corrupt += 1
            return None
        with contextlib.suppress(OSError):
            os.utime(target)  # recently used: the size cap evicts the oldest first
        with self._lock:
            self.stats.hits += 1
        return tensors["keys"], tensors["values"]

    def _verified(
        self,
        payload: bytes,
        key: BlockKey,
        parent: BlockKey | None,
        token_ids: Sequence[int],
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> dict[str, torch.Tensor] | None:
        try:
            metadata = _metadata(payload)
            tensors = load_tensors(payload)
        except (SafetensorError, ValueError, json.JSONDecodeError, UnicodeDecodeError, OSError):
            return None
        expected = {
            "format": FORMAT,
            "key": str(key),
            "parent": "" if parent is None else str(parent),
            "fingerprint": self.fingerprint,
        }
        if any(metadata.get(name) != value for name, value in expected.items()):
            return None
        try:
            if json.loads(metadata.get("token_ids", "null")) != list(token_ids):
                return None
        except json.JSONDecodeError:
            return None
        if set(tensors) != {"keys", "values"}:
            return None
        if any(tuple(t.shape) != shape or t.dtype != dtype for t in tensors.values()):
            return None
        if metadata.get("checksum") != _checksum(tensors):
            return None
        return tensors

    def _enforce_cap(self) -> None:
        with self._lock:
            files = []
            for path in self.directory.glob("*.safetensors"):
                with contextlib.suppress(OSError):  # gone meanwhile, or unreadable: not ours to count
                    info = path.stat()
                    files.append((info.st_mtime, info.st_size, path))
            total = sum(size for _, size, _ in files)
            for _, size, path in sorted(files):
                if total <= self.max_bytes:
                    break
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
                total -= size
                self.stats.evicted_files += 1

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = xxhash.xxh3_128()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(memoryview(tensors[name].contiguous().view(torch.uint8).numpy()))
    return digest.hexdigest()


def _metadata(payload: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors payload (its JSON header)."""
    if len(payload) < 8:
        raise ValueError("too short for a safetensors header")
    size = int.from_bytes(payload[:8], "little")
    if size <= 0 or 8 + size > len(payload):
        raise ValueError("header length out of range")
    header = json.loads(payload[8 : 8 + size].decode("utf-8"))
    metadata = (header.get("__metadata__") or {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise ValueError("header is not a safetensors header (an object whose __metadata__ maps names to strings)")
    return metadata
