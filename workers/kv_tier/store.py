"""The shared KV tier's store: full prefix blocks in host memory, least recently used first out, spilling
to a directory on disk, least recently used first out of that too.

An entry is a block's bytes and their xxh3-64 checksum, under a key: the namespace (model and KV layout)
and the block's prefix hash. Every read checks the checksum (and, on disk, the header that names the key
and the length): an entry that fails is dropped and the read is a miss; its bytes are never handed out.
A block lives in one place at a time: memory, or (after it was spilled) disk until it is read again.
Memory and disk are each bounded in bytes; the disk's files are this store's alone (on start, entries
left in the directory by an earlier store are removed). Thread-safe: one lock guards both levels.
"""

import hashlib
import logging
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

FILE_MAGIC = b"DKVT"
FILE_HEADER = struct.Struct("<4sQQQ")  # magic, namespace digest, block hash, data length
ENTRY_SUFFIX = ".kvb"


def checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class TierKey:
    namespace: str  # the model and its KV layout: blocks of another model never answer
    block_hash: int  # the prefix hash, whose chain starts from the organization's salt


@dataclass(frozen=True)
class TierEntry:
    data: bytes
    checksum: int


@dataclass(frozen=True)
class TierStoreStats:
    memory_entries: int
    memory_bytes: int
    disk_entries: int
    disk_bytes: int
    puts: int  # entries stored (a put of a key already held is not counted)
    hits: int  # reads answered with checked bytes
    misses: int  # reads of keys not held, or held corrupt
    corrupt: int  # entries dropped because a read found them damaged
    spilled: int  # entries moved from memory to disk
    evicted: int  # entries dropped for room (from disk, or from memory with no room on disk)


class TierStore:
    def __init__(self, memory_bytes: int, disk_dir: Path | None = None, disk_bytes: int = 0) -> None:
        if memory_bytes < 0 or disk_bytes < 0:
            raise ValueError("the KV tier's memory and disk sizes must not be negative")
        if disk_bytes and disk_dir is None:
            raise ValueError("the KV tier has a disk size but no disk directory")
        self.memory_capacity = memory_bytes
        self.disk_capacity = disk_bytes if disk_dir is not None else 0
        self._disk_dir = disk_dir
        self._lock = threading.Lock()
        self._memory: OrderedDict[TierKey, TierEntry] = OrderedDict()
        self._disk: OrderedDict[TierKey, int] = OrderedDict()  # key -> data length
        self._memory_bytes = 0
        self._disk_bytes = 0
        self._counts = dict.fromkeys(("puts", "hits", "misses", "corrupt", "spilled", "evicted"), 0)
        if disk_dir is not None and self.disk_capacity:
            disk_dir.mkdir(parents=True, exist_ok=True)
            for stale in [*disk_dir.glob(f"*{ENTRY_SUFFIX}"), *disk_dir.glob("*.partial")]:
                stale.unlink(missing_ok=True)

    # ---- the calls ------------------------------------------------------------------------------------

    def put(self, key: TierKey, data: bytes, digest: int) -> bool:
        """Stores a block whose checksum is `digest`; False when the key is already held (the entry is
        then marked used) or the block fits nowhere. Raises ValueError when `digest` does not match."""
        if checksum(data) != digest:
            raise ValueError(f"the block {key.block_hash:016x}'s bytes do not match its checksum")
        with self._lock:
            if key in self._memory:
                self._memory.move_to_end(key)
                return False
            if key in self._disk:
                self._disk.move_to_end(key)
                return False
            if len(data) > self.memory_capacity:
                stored = self._write_to_disk(key, TierEntry(data, digest))
            else:
                self._memory[key] = TierEntry(data, digest)
                self._memory_bytes += len(data)
                self._make_memory_room()
                stored = True
            self._counts["puts"] += stored
            return stored

    def present(self, keys: list[TierKey]) -> int:
        """How many of `keys`, from the first, are held (reading no bytes; a read may still find one
        corrupt)."""
        with self._lock:
            count = 0
            for key in keys:
                if key not in self._memory and key not in self._disk:
                    break
                count += 1
            return count

    def get(self, key: TierKey) -> bytes | None:
        """The block's bytes, checked; None when it is not held or failed its check (then it is dropped).
        A block read from disk moves back to memory."""
        entry = self.get_entry(key)
        return entry.data if entry is not None else None

    def get_entry(self, key: TierKey) -> TierEntry | None:
        """As `get`, with the block's checksum."""
        with self._lock:
            entry = self._memory.get(key)
            if entry is not None:
                if checksum(entry.data) != entry.checksum:
                    self._drop_corrupt(key, "memory")
                    return None
                self._memory.move_to_end(key)
                self._counts["hits"] += 1
                return entry
            if key not in self._disk:
                self._counts["misses"] += 1
                return None
            entry = self._read_from_disk(key)
            if entry is None:
                return None
            if len(entry.data) <= self.memory_capacity:
                self._remove_from_disk(key)
                self._memory[key] = entry
                self._memory_bytes += len(entry.data)
                self._make_memory_room()
            self._counts["hits"] += 1
            return entry

    def get_run(self, keys: list[TierKey], max_bytes: int) -> list[tuple[TierKey, TierEntry]]:
        """The entries of `keys` from the first, up to the first miss or until `max_bytes` would pass
        (at least one entry is returned when the first is held)."""
        found: list[tuple[TierKey, TierEntry]] = []
        total = 0
        for key in keys:
            entry = self.get_entry(key)
            if entry is None or (found and total + len(entry.data) > max_bytes):
                break
            found.append((key, entry))
            total += len(entry.data)
        return found

    def stats(self) -> TierStoreStats:
        with self._lock:
            return TierStoreStats(
                len(self._memory), self._memory_bytes, len(self._disk), self._disk_bytes, **self._counts
            )

    # ---- memory ---------------------------------------------------------------------------------------

    def _make_memory_room(self) -> None:
        while self._memory_bytes > self.memory_capacity:
            key, entry = self._memory.popitem(last=False)
            self._memory_bytes -= len(entry.data)
            if self._write_to_disk(key, entry):
                self._counts["spilled"] += 1
            else:
                self._counts["evicted"] += 1

    def _drop_corrupt(self, key: TierKey, where: str) -> None:
        log.warning("KV tier: dropped the corrupt block %016x from %s", key.block_hash, where)
        if where == "memory":
            entry = self._memory.pop(key)
            self._memory_bytes -= len(entry.data)
        else:
            self._remove_from_disk(key)
        self._counts["corrupt"] += 1
        self._counts["misses"] += 1

    # ---- disk -----------------------------------------------------------------------------------------

    def _path(self, key: TierKey) -> Path:
        assert self._disk_dir is not None
        return self._disk_dir / f"{_namespace_digest(key.namespace):016x}-{key.block_hash:016x}{ENTRY_SUFFIX}"

    def _write_to_disk(self, key: TierKey, entry: TierEntry) -> bool:
        """Writes the entry as a file, evicting the disk's least recently used entries for room; False
        when it cannot be held on disk (no disk, larger than the disk, or the write failed)."""
        size = len(entry.data)
        if size > self.disk_capacity:
            return False
        while self._disk_bytes + size > self.disk_capacity:
            oldest = next(iter(self._disk))
            self._remove_from_disk(oldest)
            self._counts["evicted"] += 1
        header = FILE_HEADER.pack(FILE_MAGIC, _namespace_digest(key.namespace), key.block_hash, size)
        path = self._path(key)
        temporary = path.with_suffix(".partial")
        try:
            with open(temporary, "wb") as file:
                file.write(header + struct.pack("<Q", entry.checksum))
                file.write(entry.data)
            os.replace(temporary, path)
        except OSError as error:
            log.warning("KV tier: could not write a block to %s: %s", path, error)
            temporary.unlink(missing_ok=True)
            return False
        self._disk[key] = size
        self._disk_bytes += size
        return True

    def _read_from_disk(self, key: TierKey) -> TierEntry | None:
        """The entry's file, checked (header, length, checksum); None, the entry dropped, when it fails."""
        size = self._disk[key]
        prefix = FILE_HEADER.size + 8
        try:
            raw = self._path(key).read_bytes()
        except OSError:
            raw = b""
        if len(raw) == prefix + size:
            magic, namespace, block_hash, length = FILE_HEADER.unpack_from(raw)
            (digest,) = struct.unpack_from("<Q", raw, FILE_HEADER.size)
            data = raw[prefix:]
            expected = (FILE_MAGIC, _namespace_digest(key.namespace), key.block_hash, size)
            if (magic, namespace, block_hash, length) == expected and checksum(data) == digest:
                return TierEntry(data, digest)
        self._drop_corrupt(key, "disk")
        return None

    def _remove_from_disk(self, key: TierKey) -> None:
        size = self._disk.pop(key)
        self._disk_bytes -= size
        self._path(key).unlink(missing_ok=True)


def _namespace_digest(namespace: str) -> int:
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little")
