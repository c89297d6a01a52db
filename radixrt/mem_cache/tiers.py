"""Building KV memory: the radix tree over the device pool, the host tier and the disk tier
under it, and the `KVSlotManager` that is the one door to all of them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixrt.config import CacheSettings, KVEventsConfig
from radixrt.mem_cache.host_pool import HostKVPool, host_pool_tokens
from radixrt.mem_cache.kv_events import Adapter, KVEventSink, ZmqEventPublisher
from radixrt.mem_cache.memory_pool import PageAllocator, ReqToTokenPool, TokenToKVPool
from radixrt.mem_cache.radix_cache import RadixCache
from radixrt.mem_cache.slot_manager import KVSlotManager
from radixrt.mem_cache.state_pool import StatePool
from radixrt.mem_cache.storage import STORAGE_BLOCK_TOKENS, KVStorage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DevicePool:
    """The device memory the tiers sit on: the allocator, the request rows and the K/V, and a
    recurrent model's state slots."""

    allocator: PageAllocator
    rows: ReqToTokenPool
    kv: TokenToKVPool
    states: StatePool | None = None


def build_slot_manager(
    pool: DevicePool,
    tiers: CacheSettings,
    fingerprint: Callable[[], str],
    adapter_of: Callable[[str], Adapter | None] = lambda salt: None,
    private_of: Callable[[str], bool] = lambda salt: False,
) -> KVSlotManager:
    """The slot manager over `pool` with the tiers the cache settings `tiers` ask for.
    `fingerprint` names the model whose KV the disk tier stores (called only when there is one: it reads the weights'
    files); `adapter_of` names the adapter of a cache namespace and `private_of` says whether
    it is a tenant's (for KV events: its token ids are not published unless the config says
    `publish_tenant_token_ids`)."""
    host = _host_pool(pool, tiers) if tiers.enable_hierarchical_cache else None
    publisher = None
    events = tiers.kv_events
    if events is not None and events.enabled and not tiers.disable_radix_cache:
        publisher = ZmqEventPublisher(events)
        logger.info("KV events on %s", events.endpoint)
    tree = RadixCache(
        pool.allocator.page_size,
        pool.allocator.free,
        disable=tiers.disable_radix_cache,
        host=host,
        write_policy=tiers.hicache_write_policy,
        events=_event_sink(pool.allocator.page_size, events, publisher, adapter_of, private_of)
        if events is not None and publisher is not None
        else None,
    )
    storage = None
    if tiers.hicache_storage_dir and host is not None:
        storage = _storage(pool, host, tiers, fingerprint())
    mode = tiers.preemption_mode or ("swap" if host else "recompute")
    return KVSlotManager(
        pool.allocator,
        pool.rows,
        tree,
        storage=storage,
        swap=mode == "swap",
        publisher=publisher,
        states=pool.states,
    )


def _event_sink(
    page_size: int,
    config: KVEventsConfig,
    publisher: ZmqEventPublisher,
    adapter_of: Callable[[str], Adapter | None],
    private_of: Callable[[str], bool],
) -> KVEventSink:
    private = (lambda salt: False) if config.publish_tenant_token_ids else private_of
    return KVEventSink(page_size, adapter_of, publisher.publish, private=private)


def _host_pool(pool: DevicePool, tiers: CacheSettings) -> HostKVPool:
    tokens = host_pool_tokens(
        pool.allocator.total_tokens, tiers.hicache_ratio, tiers.hicache_size, pool.kv
    )
    host = HostKVPool(pool.kv, tokens, pool.allocator.page_size)
    logger.info("host tier: %d tokens (%s)", host.total_tokens, tiers.hicache_write_policy)
    return host


def _storage(pool: DevicePool, host: HostKVPool, tiers: CacheSettings, model: str) -> KVStorage:
    """The disk tier: blocks of whole pages, named for the model and the K/V's shapes and
    dtype, and for a quantized pool its format too (int8 and fp8 rows have one shape and
    dtype) and, for int8, its rows' rotation (`kv_quant.rotation`; blocks written before it
    hold unrotated rows), and a recurrent model's state layout (`--mamba-ssm-dtype`): a block
    written under one KV dtype or layout is never found under another."""
    assert tiers.hicache_storage_dir is not None, "there is a disk tier"
    page_size = pool.allocator.page_size
    block = -(-STORAGE_BLOCK_TOKENS // page_size) * page_size
    like = host.device_block(torch.zeros(block, dtype=torch.long))
    fingerprint = f"{model}|{[(t.shape, t.dtype) for t in like]}"
    fmt = host.device_pool.fmt
    if fmt:
        fingerprint += f"|kv_cache_dtype={fmt.value}" + ("|rows=hadamard" if fmt.rotated else "")
    return KVStorage(
        tiers.hicache_storage_dir,
        int(tiers.hicache_storage_size * 2**30),
        block,
        fingerprint,
        like,
        pool.states.layout if pool.states is not None else None,
    )
