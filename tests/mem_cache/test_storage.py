"""The disk tier's trust boundary on a real directory: private permissions whatever the umask,
unsafe directories refused, blocks keyed by the directory's secret (a planted block with a valid
unkeyed checksum is rejected), read errors kept apart from corruption, each writer's own
temporary names, and a model fingerprint that separates weights, dtype and quantization."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_safetensors

from radixrt.executor.model_loader import model_fingerprint
from radixrt.mem_cache.storage import (
    SECRET_NAME,
    STALE_TMP_S,
    STATE_TAG,
    SUFFIX,
    BlockKV,
    KVStorage,
    write_temporary,
)

SHAPE = (2, 4, 1, 8)  # layers, block tokens, kv heads, head dim


def _block(seed: int) -> BlockKV:
    g = torch.Generator().manual_seed(seed)
    return BlockKV(torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g))


def _storage(directory: Path) -> KVStorage:
    return KVStorage(str(directory), 2**20, SHAPE[1], "test-model", _block(0))


def _written(directory: Path, tokens: list[int], seed: int = 1) -> tuple[KVStorage, str]:
    """A storage under `directory` holding one block for `tokens`; its key."""
    storage = _storage(directory)
    key = storage.block_keys(tokens, 1)[0]
    storage.write(key, _block(seed))
    storage.wait()
    return storage, key


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_directory_secret_and_blocks_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)  # the most permissive umask: the modes must not depend on it
    try:
        storage, key = _written(tmp_path / "parent" / "tier", [1, 2, 3, 4])
    finally:
        os.umask(old)
    directory = tmp_path / "parent" / "tier"
    assert _mode(directory) == 0o700
    assert _mode(directory / SECRET_NAME) == 0o600
    assert _mode(directory / (key + SUFFIX)) == 0o600
    assert len((directory / SECRET_NAME).read_bytes()) == 32
    assert sorted(p.name for p in directory.iterdir()) == sorted([SECRET_NAME, key + SUFFIX])
    storage.close()


def test_an_own_directory_is_tightened_and_an_unsafe_one_refused(tmp_path):
    readable = tmp_path / "readable"
    readable.mkdir(mode=0o755)
    os.chmod(readable, 0o755)
    _storage(readable).close()
    assert _mode(readable) == 0o700  # ours and not writable by others: taken, and tightened
    for mode in (0o777, 0o770, 0o702):
        unsafe = tmp_path / f"unsafe{mode:o}"
        unsafe.mkdir()
        os.chmod(unsafe, mode)
        with pytest.raises(PermissionError, match="writable by group or others"):
            _storage(unsafe)
        assert not (unsafe / SECRET_NAME).exists()  # refused before anything was written
    os.chmod(readable / SECRET_NAME, 0o644)
    with pytest.raises(PermissionError, match="secret .* open to group or others"):
        _storage(readable)


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another uid needs root")
def test_a_directory_owned_by_another_uid_is_refused(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 12345, 12345)
    with pytest.raises(PermissionError, match="owned by uid 12345"):
        _storage(foreign)
    mine = tmp_path / "mine"
    _storage(mine).close()
    os.chown(mine / SECRET_NAME, 12345, 12345)
    with pytest.raises(PermissionError, match="not a file this uid owns"):
        _storage(mine)


def _plant(path: Path, kv: BlockKV, checksum: str) -> None:
    path.write_bytes(save_safetensors({"k": kv.k, "v": kv.v}, {"checksum": checksum}))


def test_a_planted_block_with_a_valid_unkeyed_checksum_is_rejected(tmp_path):
    """Blocks that would have passed an unkeyed check (blake2b as the tier used to write, or
    plain sha256), and a genuine block copied from another directory (another secret), are all
    rejected on read, counted and deleted; the directory's own block is served."""
    storage, key = _written(tmp_path / "tier", [1, 2, 3, 4])
    storage.close()
    planted = _block(7)
    raw = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in planted)
    keys = _storage(tmp_path / "tier").block_keys(list(range(1, 13)), 3)
    _plant(
        tmp_path / "tier" / (keys[1] + SUFFIX),
        planted,
        hashlib.blake2b(raw, digest_size=16).hexdigest(),
    )
    _plant(tmp_path / "tier" / (keys[2] + SUFFIX), planted, hashlib.sha256(raw).hexdigest())
    other, other_key = _written(tmp_path / "other", [5, 6, 7, 8], seed=9)
    other.close()
    copied = _storage(tmp_path / "tier").block_keys([5, 6, 7, 8], 1)[0]
    assert copied == other_key  # same fingerprint, same tokens: the same name
    shutil.copy(tmp_path / "other" / (other_key + SUFFIX), tmp_path / "tier" / (copied + SUFFIX))

    restarted = _storage(tmp_path / "tier")
    assert [restarted.read(k) for k in (keys[1], keys[2], copied)] == [None, None, None]
    assert restarted.rejected_blocks == 3
    for k in (keys[1], keys[2], copied):
        assert not (tmp_path / "tier" / (k + SUFFIX)).exists() and not restarted.contains(k)
    served = restarted.read(key)
    assert served is not None and all(torch.equal(a, b) for a, b in zip(served, _block(1)))
    restarted.close()


def test_a_read_error_is_a_miss_that_leaves_the_file(tmp_path):
    """An unreadable block file (here a directory in its place: EISDIR, which root gets as surely
    as anyone, where EACCES would need another uid) is a miss, not corruption: nothing is
    deleted or counted, and once readable again the block is served."""
    storage, key = _written(tmp_path, [1, 2, 3, 4])
    path = tmp_path / (key + SUFFIX)
    data = path.read_bytes()
    path.unlink()
    path.mkdir()
    assert storage.read(key) is None
    assert path.is_dir() and storage.contains(key) and storage.rejected_blocks == 0
    path.rmdir()
    path.write_bytes(data)
    served = storage.read(key)
    assert served is not None and torch.equal(served.k, _block(1).k)
    storage.close()


def test_each_writer_has_its_own_temporary_and_dead_writers_leftovers_go(tmp_path):
    storage, key = _written(tmp_path, [1, 2, 3, 4])
    storage.close()
    names = {write_temporary(tmp_path, key, b"x") for _ in range(3)}
    assert len(names) == 3 and all(_mode(Path(n)) == 0o600 for n in names)
    live = Path(names.pop())  # this process's, just written: a live writer's
    stale = Path(names.pop())  # this pid's, but untouched for longer than any write takes
    old = time.time() - STALE_TMP_S - 60
    os.utime(stale, (old, old))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    gone = tmp_path / f"{key}.{dead.stdout.strip()}.abc123.tmp"  # a writer that exited
    gone.write_bytes(b"half a block")
    Path(names.pop()).unlink()
    restarted = _storage(tmp_path)
    assert live.exists() and not stale.exists() and not gone.exists()
    assert restarted.contains(key)
    restarted.close()


def test_the_fingerprint_separates_weights_dtype_and_quantization(tiny_model_dir, tmp_path):
    """Same weights in another folder: the same fingerprint. dtype, quantization, config or
    tensor values (same header and sizes) changed: another one."""
    base = model_fingerprint(tiny_model_dir, torch.float32, "float")
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    assert model_fingerprint(copy, torch.float32, "float") == base
    assert model_fingerprint(copy, torch.float32, "int8") != base
    assert model_fingerprint(copy, torch.bfloat16, "float") != base
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    data[8 + header_len] ^= 0xFF  # the first tensor's first byte: a retrained model's
    weights.write_bytes(bytes(data))
    assert model_fingerprint(copy, torch.float32, "float") != base
    shutil.copy(tiny_model_dir / weights.name, weights)
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] *= 10  # the same weights computing other KV
    (copy / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(copy, torch.float32, "float") != base


def test_a_reseed_leaves_the_blocks_of_older_weights_unfound(tmp_path):
    """New weights (`KVSlotManager.forget_weights` reseeds with a label of its own): the keys
    of a prompt's blocks change, so a block written before is never read for it again."""
    storage = _storage(tmp_path)
    ids = list(range(SHAPE[1]))
    (before,) = storage.block_keys(ids, 1)
    storage.write(before, _block(1))
    storage.wait()
    storage.reseed("update-1")
    (after,) = storage.block_keys(ids, 1)
    assert after != before and not storage.contains(after) and storage.read(after) is None
    storage.close()


def test_a_state_is_stored_beside_its_block_and_checked_as_one(tmp_path):
    """A recurrent model's state after a block is a file of its own (named by the block's key
    and STATE_TAG), read back equal; a block's file renamed to a state's name (the key is bound
    into the checksum) and a state of another layout are rejected, counted and deleted; and the
    state layout enters the fingerprint, so a storage of another `--mamba-ssm-dtype` finds none
    of it."""
    layout = [(torch.Size([3, 2]), torch.float32), (torch.Size([4]), torch.bfloat16)]
    state = [torch.randn(3, 2), torch.randn(4).to(torch.bfloat16)]
    storage = KVStorage(str(tmp_path), 2**20, SHAPE[1], "test-model", _block(0), layout)
    key, other = storage.block_keys([1, 2, 3, 4, 5, 6, 7, 8], 2)
    storage.write(key, _block(1))
    storage.write_state(key, state)
    storage.write(other, _block(2))
    storage.wait()
    read = storage.read_state(key)
    assert read is not None and all(torch.equal(a, b) for a, b in zip(read, state))
    assert storage.read_state(other) is None and storage.rejected_blocks == 0
    shutil.copy(tmp_path / (other + SUFFIX), tmp_path / (other + STATE_TAG + SUFFIX))
    storage._index[other + STATE_TAG] = 1  # as a restart's scan would index it
    assert storage.read_state(other) is None and storage.rejected_blocks == 1
    storage.close()
    wider = [(torch.Size([3, 2]), torch.float32), (torch.Size([4]), torch.float32)]
    restarted = KVStorage(str(tmp_path), 2**20, SHAPE[1], "test-model", _block(0), wider)
    assert restarted.block_keys([1, 2, 3, 4], 1)[0] != key  # never looked up under key
    restarted._index[key + STATE_TAG] = 1  # the other layout's file, named as this one's
    assert restarted.read_state(key) is None and restarted.rejected_blocks == 1
    assert not (tmp_path / (key + STATE_TAG + SUFFIX)).exists()
    restarted.close()
