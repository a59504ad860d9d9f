"""What Engine.load builds around a model for its KV: the pool (sized by tokens or memory), the
attention over it, the prefix cache and its disk store."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from appliance.engine.kv_cache import PagedKVCache
from appliance.engine.kv_sizing import pool_tokens
from appliance.engine.kv_store_disk import DiskStore
from appliance.engine.prefix_cache import PrefixCache, root_hash
from appliance.engine.sequence_cache import SequenceCache
from appliance.engine.sparse import make_attention
from appliance.options import KV_BLOCK, SparseConfig

log = logging.getLogger("appliance.engine")

DEFAULT_DISK_BYTES = 4 << 30


@dataclass
class KVSetup:
    cache: PagedKVCache
    attention: object
    prefix: PrefixCache | None
    sequences: SequenceCache
    sizing: str


def build_kv(cfg, kv: str, sparse: SparseConfig | None, max_context: int, *, weight_bytes: int,
             kv_cache_tokens: int | None = None, kv_cache_memory: str | None = None,
             prefix_cache: bool = False, identity: dict | None = None, kv_cache_dir=None,
             kv_cache_disk_bytes: int = DEFAULT_DISK_BYTES) -> KVSetup:
    """identity: what names the model and its weights for the prefix cache's root (with the KV
    format and attention settings added here)."""
    block = sparse.block if sparse else KV_BLOCK
    layers, n_kv, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    # One block's pool with the attention's extra rows tells what a token costs in all.
    probe = PagedKVCache(layers, n_kv, hd, kind=kv, block_size=block, capacity_tokens=block)
    make_attention(probe, hd, layers, sparse)
    tokens, sizing = pool_tokens(probe.bytes_per_token_per_layer * layers, max_context, kv_cache_tokens,
                                 kv_cache_memory, weight_bytes)
    cache = PagedKVCache(layers, n_kv, hd, kind=kv, block_size=block, capacity_tokens=tokens)
    attention = make_attention(cache, hd, layers, sparse)
    prefix = None
    if prefix_cache:
        sparse_id = None if sparse is None else (sparse.k, sparse.block, sparse.probe, sparse.probe_mode)
        root = root_hash(kv=kv, block=block, sparse=sparse_id, **(identity or {}))
        store = None
        if kv_cache_dir:
            store = DiskStore(Path(kv_cache_dir), kv_cache_disk_bytes, root, cache.block_layout())
            log.info("KV cache on disk: %s (%d files, %.1f of %.1f GiB)", store.root_dir, store.stats().files,
                     store.stats().bytes / 2**30, kv_cache_disk_bytes / 2**30)
        prefix = PrefixCache(cache, root, sparse.k if sparse else None, store)
    log.info("KV pool: %d tokens (%d blocks, %.0f MiB; %s)", cache.capacity_tokens, cache.n_blocks,
             cache.nbytes / 2**20, sizing)
    return KVSetup(cache, attention, prefix, SequenceCache(cache, prefix, layers, sparse is not None), sizing)
