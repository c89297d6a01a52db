"""The disk tier: KV of token-prefix blocks as safetensors files, found again after a restart.

A block is `block_tokens` consecutive tokens starting at a multiple of `block_tokens`. Its file
is named by a chained hash: block i's key hashes block i-1's key and block i's token ids, and
block 0's hashes a fingerprint of the model and the KV layout, so one key names one prefix of
one model. A file holds tensors `k` and `v` (`[layers, block_tokens, kv_heads, head_dim]`) and,
in the safetensors header, a checksum of their bytes: a corrupt or truncated file is detected,
deleted and treated as a miss. The directory is bounded by `max_bytes`, least recently used
first (file modification times carry the order across restarts). Files are written by one
background thread; a block becomes visible once its file is complete (written, then renamed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
STORAGE_BLOCK_TOKENS = 64  # rounded up to whole pages


class BlockKV(NamedTuple):
    """One block's K and V, `[layers, block_tokens, kv_heads, head_dim]` each."""

    k: torch.Tensor
    v: torch.Tensor


def _checksum(kv: BlockKV) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for t in kv:
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class KVStorage:
    """Blocks of KV on disk under `directory`, keyed by prefix hash; see the module docstring."""

    def __init__(
        self,
        directory: str,
        max_bytes: int,
        block_tokens: int,
        fingerprint: str,
        like: BlockKV,
    ):
        """`like`: a block of the right shapes and dtype (what a read must return); the
        fingerprint names the model whose KV this is."""
        self.dir = Path(directory)
        self.like = [(t.shape, t.dtype) for t in like]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self.seed = hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, oldest first
        self._pending: set[str] = set()  # keys being written
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="radixrt-storage")
        self._futures: list[Future] = []
        self.corrupt_files = 0
        self._scan()

    def _scan(self) -> None:
        """Index the files already there (a restart), oldest first; drop leftovers of writes."""
        files = []
        for path in self.dir.iterdir():
            if path.suffix == SUFFIX:
                stat = path.stat()
                files.append((stat.st_mtime, path.stem, stat.st_size))
            elif path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
        for _, key, size in sorted(files):
            self._index[key] = size
        self._trim()

    # ---- keys ------------------------------------------------------------------------------
    def block_keys(self, token_ids: list[int], count: int, salt: str = "") -> list[str]:
        """Keys of the first `count` whole blocks of `token_ids` cached under `salt` (a salt
        enters the chain's seed, so one salt's blocks are never found under another)."""
        keys, prev = [], self.seed
        if salt:
            prev = hashlib.blake2b(prev + salt.encode(), digest_size=16).digest()
        b = self.block_tokens
        for i in range(count):
            block = np.asarray(token_ids[i * b : (i + 1) * b], dtype=np.int64).tobytes()
            prev = hashlib.blake2b(prev + block, digest_size=16).digest()
            keys.append(prev.hex())
        return keys

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._index.values())

    # ---- write -----------------------------------------------------------------------------
    def write(self, key: str, kv: BlockKV) -> None:
        """Queue a block's file for the writer thread (nothing when it is there already)."""
        with self._lock:
            if key in self._index or key in self._pending:
                return
            self._pending.add(key)
        self._futures = [f for f in self._futures if not f.done()]
        self._futures.append(self._writer.submit(self._write, key, kv))

    def _write(self, key: str, kv: BlockKV) -> None:
        path = self.dir / (key + SUFFIX)
        tmp = path.with_name(path.name + ".tmp")
        try:
            data = save_safetensors(
                {"k": kv.k.contiguous(), "v": kv.v.contiguous()}, {"checksum": _checksum(kv)}
            )
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as e:  # a full disk or a vanished directory costs the block, not the server
            logger.warning("could not write KV block %s: %s", path, e)
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._pending.discard(key)
            return
        with self._lock:
            self._pending.discard(key)
            self._index[key] = len(data)
        self._trim()

    def _trim(self) -> None:
        """Remove the least recently used files until the directory fits `max_bytes`."""
        with self._lock:
            total = sum(self._index.values())
            victims = []
            while total > self.max_bytes and self._index:
                key, size = self._index.popitem(last=False)
                total -= size
                victims.append(key)
        for key in victims:
            (self.dir / (key + SUFFIX)).unlink(missing_ok=True)

    def wait(self) -> None:
        """Block until every queued write is on disk."""
        for future in list(self._futures):
            future.result()
        self._futures.clear()

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    # ---- read ------------------------------------------------------------------------------
    def read(self, key: str) -> BlockKV | None:
        """The block stored under `key`; None when there is none or its file is corrupt or of
        another shape (then it is deleted)."""
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self.dir / (key + SUFFIX)
        try:
            data = path.read_bytes()
            tensors = load_safetensors(data)
            kv = BlockKV(tensors["k"], tensors["v"])
            checksum = _header_checksum(data)
            ok = checksum == _checksum(kv) and [(t.shape, t.dtype) for t in kv] == self.like
        except Exception as e:  # safetensors raises its own error types on a malformed file
            logger.warning("KV block %s is unreadable (%s); dropping it", path, e)
            ok = False
        if not ok:
            self._drop(key)
            return None
        try:
            os.utime(path)  # the recency order survives a restart
        except OSError:
            pass  # removed by the size bound meanwhile: the block was read all the same
        return kv

    def _drop(self, key: str) -> None:
        self.corrupt_files += 1
        with self._lock:
            self._index.pop(key, None)
        (self.dir / (key + SUFFIX)).unlink(missing_ok=True)


def _header_checksum(data: bytes) -> str | None:
    """The checksum recorded in a safetensors file's metadata."""
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    return header.get("__metadata__", {}).get("checksum")
