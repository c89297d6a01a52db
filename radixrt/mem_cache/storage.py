"""The disk tier: KV of token-prefix blocks as safetensors files, found again after a restart.

A block is `block_tokens` consecutive tokens starting at a multiple of `block_tokens`. Its file
is named by a chained hash: block i's key hashes block i-1's key and block i's token ids, and
block 0's hashes a fingerprint of the model (`model_loader.model_fingerprint`: weights, config,
dtype, quantization) and the KV layout, so one key names one prefix of one model. A file holds
tensors `k` and `v` (`[layers, block_tokens, kv_heads, head_dim]`) and, in the safetensors
header, an HMAC-SHA256 of its name and their bytes under the directory's secret (`SECRET_NAME`,
32 random bytes made on first use): a corrupt, truncated or planted file (one whose checksum is
right but unkeyed, or keyed by another directory's secret) does not verify, is deleted, counted
in `rejected_blocks` and treated as a miss. A file that cannot be read (an OSError: EACCES,
EIO) is a miss too but stays: that is no proof of corruption. The directory is bounded by
`max_bytes`, least recently used first (file modification times carry the order across
restarts).

A recurrent model's state after a block (`state_pool.StatePool.save`: one tensor per state
buffer, `s0`, `s1`, ...) is a file of its own beside the block's, named by the block's key and
`STATE_TAG`, checked the same way against the pool's state layout: the KV blocks up to a prefix
and the state at its end are what a restart needs to resume there.

Files are written by one background thread; a block becomes visible once its file is complete:
each write goes to its own temporary name (`<key>.<pid>.<random>.tmp`, so writers in several
processes sharing the directory never collide), then is renamed. A scan removes the temporary
files of writers that are no longer running (or that have not written for `STALE_TMP_S`).

The directory is made 0700 and every file 0600 whatever the umask; an existing directory is
taken only if this uid owns it and neither group nor others may write it (it is tightened to
0700), and the secret only if this uid owns it and nobody else may read it. Anything else is
refused with a one-line `PermissionError` at start: whoever can write the directory or read the
secret could feed KV into this model's answers.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
SECRET_NAME = "radixrt-storage.key"
SECRET_BYTES = 32
STORAGE_BLOCK_TOKENS = 64  # rounded up to whole pages
DIR_MODE = 0o700
STALE_TMP_S = 600.0
FILE_MODE = 0o600
STATE_TAG = "-state"  # a state file's name: its block's key and this
Layout = list[tuple[torch.Size, torch.dtype]]


class BlockKV(NamedTuple):
    """One block's K and V, `[layers, block_tokens, kv_heads, head_dim]` each."""

    k: torch.Tensor
    v: torch.Tensor


def block_checksum(secret: bytes, key: str, tensors: Sequence[torch.Tensor]) -> str:
    """HMAC-SHA256 of a file's name (a block's key, or a state's) and its tensors' bytes in
    order (K and V, or a state's) under the directory's secret: binding the name makes a valid
    file renamed to another name fail too."""
    mac = hmac.new(secret, key.encode(), hashlib.sha256)
    for t in tensors:
        # an ndarray is a buffer; numpy declares `__buffer__` for Python 3.12 and later only
        mac.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    return mac.hexdigest()


def open_directory(directory: Path) -> None:
    """Create `directory` 0700, or check that an existing one is safe to trust (see the module
    docstring) and tighten it to 0700."""
    try:
        directory.mkdir(mode=DIR_MODE, parents=True)
    except FileExistsError:
        pass
    info = directory.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"disk tier {directory} is not a directory")
    if info.st_uid != os.geteuid():
        raise PermissionError(
            f"disk tier {directory} is owned by uid {info.st_uid}, not this process's "
            f"{os.geteuid()}: refused"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"disk tier {directory} is writable by group or others "
            f"(mode {stat.S_IMODE(info.st_mode):o}): refused; chmod 700 it"
        )
    if stat.S_IMODE(info.st_mode) != DIR_MODE:
        os.chmod(directory, DIR_MODE)  # mkdir's mode is cut by the umask; readers are too many


def load_secret(directory: Path) -> bytes:
    """The directory's HMAC secret: made (0600, from os.urandom) on first use, read after. It
    is written under a temporary name and linked into place, so a process starting beside
    another never reads half a secret and both end up with the same one."""
    path = directory / SECRET_NAME
    if not path.exists():
        tmp = write_temporary(directory, SECRET_NAME, os.urandom(SECRET_BYTES))
        try:
            os.link(tmp, path)  # fails if another process made it first: theirs is used
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    info = path.lstat()
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        raise PermissionError(f"disk tier secret {path} is not a file this uid owns: refused")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(
            f"disk tier secret {path} is open to group or others "
            f"(mode {stat.S_IMODE(info.st_mode):o}): refused; delete it (its blocks are lost)"
        )
    secret = path.read_bytes()
    if len(secret) != SECRET_BYTES:
        raise PermissionError(f"disk tier secret {path} is not {SECRET_BYTES} bytes: refused")
    return secret


def _leftover(tmp: Path) -> bool:
    """Whether a temporary file (`<stem>.<pid>.<random>.tmp`) is a dead writer's: its process
    is not running here, or it has not been written to for `STALE_TMP_S` (no block takes that
    long; this also catches a pid reused, e.g. by a container restarted under the same pid)."""
    if time.time() - tmp.stat().st_mtime > STALE_TMP_S:
        return True
    parts = tmp.name.split(".")
    if len(parts) < 4 or not parts[-3].isdigit():
        return True
    try:
        os.kill(int(parts[-3]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's process, running
    return False


class KVStorage:
    """Blocks of KV on disk under `directory`, keyed by prefix hash; see the module docstring."""

    def __init__(
        self,
        directory: str,
        max_bytes: int,
        block_tokens: int,
        fingerprint: str,
        like: BlockKV,
        state_layout: Layout | None = None,
    ):
        """`like`: a block of the right shapes and dtype (what a read must return);
        `state_layout`: a recurrent model's state's (`StatePool.layout`), which enters the
        fingerprint; the fingerprint names the model whose KV this is. Raises PermissionError
        for a directory or secret this process must not trust."""
        self.dir = Path(directory)
        self.like: Layout = [(t.shape, t.dtype) for t in like]
        self.state_layout = state_layout
        if state_layout is not None:
            fingerprint += f"|states={state_layout}"
        open_directory(self.dir)
        self._secret = load_secret(self.dir)
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self.seed = hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, oldest first
        self._pending: set[str] = set()  # keys being written
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="radixrt-storage")
        self._futures: list[Future[None]] = []
        self.rejected_blocks = 0  # files that failed their checksum or shape check (deleted)
        self._scan()

    def _scan(self) -> None:
        """Index the block files already there (a restart), oldest first; remove temporary
        files whose writer is gone."""
        files = []
        for path in self.dir.iterdir():
            try:
                if path.suffix == SUFFIX:
                    info = path.stat()
                    files.append((info.st_mtime, path.stem, info.st_size))
                elif path.name.endswith(TMP_SUFFIX) and _leftover(path):
                    path.unlink(missing_ok=True)
            except FileNotFoundError:
                pass  # renamed or trimmed by another process sharing the directory
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

    def reseed(self, label: str) -> None:
        """Key every block from now on under a chain seeded with `label` too (new weights: an
        update's unique label): blocks written before are never found again, here or after a
        restart, and age out of the directory by its size bound."""
        self.seed = hashlib.blake2b(self.seed + label.encode(), digest_size=16).digest()

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def contains_state(self, key: str) -> bool:
        """Whether the state after block `key` is stored (or being written)."""
        return self.contains(key + STATE_TAG)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._index.values())

    # ---- write -----------------------------------------------------------------------------
    def write(self, key: str, kv: BlockKV) -> None:
        """Queue a block's file for the writer thread (nothing when it is there already)."""
        self._queue(key, {"k": kv.k, "v": kv.v})

    def write_state(self, key: str, state: Sequence[torch.Tensor]) -> None:
        """Queue the file of the state after block `key` (CPU tensors of `state_layout`)."""
        assert self.state_layout is not None, "a recurrent model's storage"
        self._queue(key + STATE_TAG, {f"s{i}": t for i, t in enumerate(state)})

    def _queue(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        with self._lock:
            if key in self._index or key in self._pending:
                return
            self._pending.add(key)
        self._futures = [f for f in self._futures if not f.done()]
        self._futures.append(self._writer.submit(self._write, key, tensors))

    def _write(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        path = self.dir / (key + SUFFIX)
        tensors = {name: t.contiguous() for name, t in tensors.items()}
        checksum = block_checksum(self._secret, key, list(tensors.values()))
        data = save_safetensors(tensors, {"checksum": checksum})
        try:
            os.replace(write_temporary(self.dir, key, data), path)
        except OSError as e:  # a full disk or a vanished directory costs the block, not the server
            logger.warning("could not write KV block %s: %s", path, e)
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
        """The block stored under `key`; None when there is none, when its file cannot be read
        (an OSError: the file stays, a later read may succeed), or when it is malformed, does
        not verify under the secret or has another shape (then it is deleted and counted)."""
        tensors = self._read(key, ("k", "v"), self.like)
        return None if tensors is None else BlockKV(*tensors)

    def read_state(self, key: str) -> list[torch.Tensor] | None:
        """The state stored after block `key`, as `read` reads a block (of `state_layout`)."""
        assert self.state_layout is not None, "a recurrent model's storage"
        names = tuple(f"s{i}" for i in range(len(self.state_layout)))
        return self._read(key + STATE_TAG, names, self.state_layout)

    def _read(self, key: str, names: tuple[str, ...], layout: Layout) -> list[torch.Tensor] | None:
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self.dir / (key + SUFFIX)
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # removed by another process sharing the directory
            with self._lock:
                self._index.pop(key, None)
            return None
        except OSError as e:
            logger.warning("could not read KV block %s (%s): a miss; the file stays", path, e)
            return None
        tensors = self._verified(key, data, names, layout)
        if tensors is None:
            self._reject(key)
            return None
        try:
            os.utime(path)  # the recency order survives a restart
        except OSError:
            pass  # removed by the size bound meanwhile: the block was read all the same
        return tensors

    def _verified(
        self, key: str, data: bytes, names: tuple[str, ...], layout: Layout
    ) -> list[torch.Tensor] | None:
        """The tensors `names` a file's bytes hold, or None (logged) when they do not parse
        (or hold other names), their checksum is not the HMAC of `key` and their bytes under
        this directory's secret, or they are not of `layout`'s shapes and dtypes."""
        path = self.dir / (key + SUFFIX)
        try:
            stored = load_safetensors(data)
            if sorted(stored) != sorted(names):
                raise ValueError(f"tensors {sorted(stored)}, not {sorted(names)}")
            tensors = [stored[name] for name in names]
            recorded = _header_checksum(data)
        except Exception as e:  # safetensors raises its own error types on a malformed file
            logger.warning("KV block %s is malformed (%s); deleting it", path, e)
            return None
        expected = block_checksum(self._secret, key, tensors)
        if not isinstance(recorded, str) or not hmac.compare_digest(recorded, expected):
            logger.warning("KV block %s does not verify under the secret; deleting it", path)
            return None
        if [(t.shape, t.dtype) for t in tensors] != layout:
            logger.warning("KV block %s has another layout; deleting it", path)
            return None
        return tensors

    def _reject(self, key: str) -> None:
        self.rejected_blocks += 1
        with self._lock:
            self._index.pop(key, None)
        (self.dir / (key + SUFFIX)).unlink(missing_ok=True)


def write_temporary(directory: Path, stem: str, data: bytes) -> str:
    """Write `data` to a new 0600 file `<stem>.<pid>.<random>.tmp` in `directory` and return
    its path, for the caller to rename or link into place (removed again if the write fails).
    The name is this writer's alone; the pid in it lets a scan tell a dead writer's leftover."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{stem}.{os.getpid()}.", suffix=TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), FILE_MODE)  # mkstemp's 0600 is cut by the umask
            f.write(data)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _header_checksum(data: bytes) -> object:
    """The checksum recorded in a safetensors file's metadata (None when there is none)."""
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    return header.get("__metadata__", {}).get("checksum")
