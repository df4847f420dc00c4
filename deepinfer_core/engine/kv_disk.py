"""The disk tier of the KV cache: one file per full paged block, named by its chain hash, in a
directory that records whose blocks they are.

``<dir>/deepinfer-kv-tier.json`` holds the identity of the model and cache layout the blocks were
computed for (``identity``: the model's config and weights, the compute dtype, the block size,
every paged cache group); a directory made for another identity is refused, never mixed. A block
is ``<dir>/blocks/<hash[:2]>/<hash>.kv``: a header (magic, the identity's digest, the block's
hash, the payload's length and blake2b checksum) and the block's bytes as the host tier holds
them. Start-up checks every file's header and length (a truncated or foreign file is refused
with its name); a payload whose checksum fails when it is read is dropped and recomputed. The
files are written and read by the tier's I/O thread (``kv_tiers.KVTiers``); the index (LRU,
least recently used first) is the engine thread's.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import struct
from collections import OrderedDict
from pathlib import Path

import torch

from deepinfer_core.config import ConfigError

log = logging.getLogger("deepinfer")

MANIFEST = "deepinfer-kv-tier.json"
LOCK = ".lock"
FORMAT = 1
MAGIC = b"DIKVBLK1"
HEADER = struct.Struct("<8s32s16sQ32s")  # magic, identity digest, block hash, payload bytes, payload checksum
FIX = "point kv_disk_dir (--kv-disk-dir) at another directory, or empty this one to start its tier afresh"


def digest_of(identity: dict) -> bytes:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()


def checksum(payload: memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


class DiskTier:
    """Block files in ``directory``, at most ``capacity`` of them (``index``: hash -> None, least
    recently used first). ConfigError when the directory belongs to another identity, is not a
    tier, is corrupt, or is used by another engine."""

    def __init__(self, directory: str | os.PathLike, capacity: int, block_bytes: int, identity: dict):
        self.dir = Path(directory).expanduser()
        self.capacity = capacity
        self.block_bytes = block_bytes
        self.identity = {"format": FORMAT, **identity, "block_bytes": block_bytes}
        self.digest = digest_of(self.identity)
        self._lock = self._take_lock()
        try:
            self._check_manifest()
            self.index: OrderedDict[bytes, None] = OrderedDict((h, None) for h in self._scan())
        except BaseException:
            self._lock.close()
            raise
        while len(self.index) > capacity:  # kv_disk_gb was lowered since the files were written
            self.delete(self.index.popitem(last=False)[0])

    def _take_lock(self):
        """The directory (made if need be), locked for this engine: its lock file, held open."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            lock = open(self.dir / LOCK, "a")  # noqa: SIM115 - held (locked) for the engine's life
        except OSError as e:
            raise ConfigError(f"kv_disk_dir {self.dir}: cannot be used as the KV disk tier ({e})") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise ConfigError(f"kv_disk_dir {self.dir} is in use by another engine (its lock is held); close that one "
                              f"(LLM.close()) or give this one another directory") from None
        return lock

    def _check_manifest(self) -> None:
        """Write the identity into a new directory, or check an existing one's."""
        manifest = self.dir / MANIFEST
        if not manifest.exists():
            others = [p.name for p in self.dir.iterdir() if p.name != LOCK]
            if others:
                raise ConfigError(f"kv_disk_dir {self.dir} is not empty and is not a DeepInfer KV tier (no {MANIFEST}; "
                                  f"it holds {', '.join(sorted(others)[:3])}...); {FIX}")
            manifest.write_text(json.dumps(self.identity, indent=1, sort_keys=True) + "\n")
            return
        try:
            stored = json.loads(manifest.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"kv_disk_dir {self.dir}: {MANIFEST} is corrupt ({e}); {FIX}") from None
        if stored != self.identity:
            differ = sorted(k for k in set(stored) | set(self.identity) if stored.get(k) != self.identity.get(k))
            raise ConfigError(f"kv_disk_dir {self.dir} holds the KV blocks of another model or cache layout ({', '.join(differ)} "
                              f"differ from this engine's); {FIX}")

    def path(self, h: bytes) -> Path:
        name = h.hex()
        return self.dir / "blocks" / name[:2] / f"{name}.kv"

    def _scan(self) -> list[bytes]:
        """The blocks already in the directory, oldest first; ConfigError naming a corrupt file."""
        found = []
        for path in self.dir.glob("blocks/*/*"):
            if path.suffix == ".tmp":  # a write cut short (the process died): never renamed into place
                path.unlink(missing_ok=True)
                continue
            problem = self._check_header(path)
            if problem:
                raise ConfigError(f"kv_disk_dir {self.dir}: {path} is not a block of this tier ({problem}): the disk tier is "
                                  f"corrupt; delete that file, or {FIX}")
            found.append((path.stat().st_mtime_ns, bytes.fromhex(path.stem)))
        return [h for _, h in sorted(found)]

    def _check_header(self, path: Path) -> str | None:
        try:
            if path.stat().st_size != HEADER.size + self.block_bytes:
                return f"{path.stat().st_size} bytes, not {HEADER.size + self.block_bytes}"
            with open(path, "rb") as f:
                magic, digest, h, length, _ = HEADER.unpack(f.read(HEADER.size))
        except (OSError, struct.error) as e:
            return str(e)
        if magic != MAGIC:
            return "no block header"
        if digest != self.digest:
            return "written for another model or cache layout"
        if h.hex() != path.stem or length != self.block_bytes:
            return "its header names another block"
        return None

    # ---- run on the I/O thread ------------------------------------------------------------------
    def write(self, h: bytes, payload: torch.Tensor) -> None:
        """Write one block's bytes (a uint8 host tensor) under ``h``, atomically."""
        data = memoryview(payload.numpy())
        path = self.path(h)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, self.digest, h, len(data), checksum(data)))
            f.write(data)
        os.replace(tmp, path)

    def read(self, h: bytes, out: torch.Tensor) -> bool:
        """Read block ``h`` into ``out`` (uint8 host tensor); False (and the file deleted) when it
        is missing or its checksum fails."""
        path = self.path(h)
        try:
            with open(path, "rb") as f:
                magic, digest, stored, length, check = HEADER.unpack(f.read(HEADER.size))
                data = memoryview(out.numpy())
                ok = (magic, digest, stored, length) == (MAGIC, self.digest, h, len(data)) and f.readinto(data) == len(data)
            ok = ok and checksum(data) == check
        except (OSError, struct.error):
            ok = False
        if not ok:
            log.error("KV disk tier: %s is missing or corrupt (header or checksum); dropped, its tokens are recomputed", path)
            path.unlink(missing_ok=True)
        else:
            os.utime(path)  # recently used: kept longest when a restart orders the index by time
        return ok

    def delete(self, h: bytes) -> None:
        self.path(h).unlink(missing_ok=True)

    def close(self) -> None:
        self._lock.close()
