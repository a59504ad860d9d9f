"""Automatic prefix cache (docs/engine.md, "Prefix cache"): full KV blocks found again by what they hold.

A full block is named by a hash of its tokens chained to the hash of the block before it, so
equal names mean equal prefixes; the chain starts from a root that names the model, its
weights and KV formats and the attention settings, so blocks of another model or format can
never match. Image tokens add the image's content to their block's hash (every image token
has the same id). Blocks are shared between sequences by reference count (BlockPool) and
stay after their sequences end, idle, until the pool needs them: least recently used first,
spilled to the disk store (kv_store_disk.py) if there is one.

What a hit must reproduce, and so what a block carries:
- its K/V rows and, with block-sparse attention, its bound or probe rows: they live in the
  pool arrays at the block's index, so a shared block brings them along;
- with block-sparse attention, the prompt importance decode reserves blocks by. It is a sum
  over the prompt's queries, so the state after a prefix is the per-block mass that prefix's
  queries gave (`importance`, float32[n_layers, blocks so far]), kept on the block where a
  prefill chunk ended; a hit under sparse attention ends at such a block.
Under sparse attention only blocks computed by prefill rows, or lying where decode attends
to every block (below k blocks), are cached: past that point decode chooses blocks unlike a
prefill, and a hit must give what a cold prefill gives.
"""
from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field

import numpy as np

from appliance.errors import KVCacheFullError

# Bump when what a cached block holds changes meaning: the KV quantizers, the attention or
# model numerics that write K/V, the importance definition, the per-block arrays.
CACHE_FORMAT_VERSION = 1
HASH_BYTES = 16


def root_hash(**identity) -> bytes:
    """The chain's start: everything that must agree for two KV blocks to be interchangeable."""
    text = ";".join(f"{k}={identity[k]}" for k in sorted(identity))
    return hashlib.blake2b(f"appliance-kv/{CACHE_FORMAT_VERSION};{text}".encode(),
                           digest_size=HASH_BYTES).digest()


def block_hash(parent: bytes, tokens, extra: bytes = b"") -> bytes:
    """The name of a full block: its tokens (and image content), after everything before it."""
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    h.update(extra)
    return h.digest()


def image_digest(pixel_values: np.ndarray, grid_thw) -> bytes:
    """What an image contributes to the hash of the blocks its tokens sit in."""
    h = hashlib.blake2b(np.ascontiguousarray(pixel_values).tobytes(), digest_size=HASH_BYTES)
    h.update(np.asarray(grid_thw, dtype=np.int64).tobytes())
    return h.digest()


@dataclass
class BlockMeta:
    """What the cache knows of one registered block besides its rows."""

    parent: bytes
    tokens: np.ndarray                    # int32[block_size]
    importance: np.ndarray | None = None  # float32[n_layers, index + 1] (sparse, at a chunk end)


class BlockPool:
    """Physical blocks: free, held by sequences (reference counts) or idle in the cache (LRU).

    Only a full, registered block can be idle: it keeps its rows and its name until the pool
    needs the space, then `on_evict(block, hash, meta)` runs (the disk spill) and it is reused.
    """

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.refs = [0] * n_blocks
        # Lowest ids first: a fresh pool fills from the start of the arrays.
        self.free = list(range(n_blocks - 1, -1, -1))
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.meta: dict[int, BlockMeta] = {}
        self.on_evict = None
        self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks a sequence could get now: free ones and idle cached ones."""
        return len(self.free) + len(self.idle)

    @property
    def held(self) -> int:
        """Blocks some sequence holds."""
        return self.n_blocks - self.available

    def take(self) -> int:
        """A block for new rows, held once; evicts the least recently used idle block if none is free."""
        if self.free:
            block = self.free.pop()
        elif self.idle:
            block, _ = self.idle.popitem(last=False)
            self._evict(block)
        else:
            raise KVCacheFullError(f"KV cache full: all {self.n_blocks} blocks are in use")
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        if self.refs[block] == 0:
            self.idle.pop(block, None)
        self.refs[block] += 1

    def drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.idle[block] = None          # most recently used end
            else:
                self.free.append(block)

    def register(self, block: int, name: bytes, meta: BlockMeta) -> bool:
        """Name a full block held by a sequence. False if another block has that name already
        (two sequences computed the same prefix at once): this one stays private."""
        if name in self.block_of or block in self.hash_of:
            return False
        self.block_of[name] = block
        self.hash_of[block] = name
        self.meta[block] = meta
        return True

    def lookup(self, name: bytes) -> int | None:
        return self.block_of.get(name)

    def _evict(self, block: int) -> None:
        name = self.hash_of.pop(block)
        meta = self.meta.pop(block)
        del self.block_of[name]
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(block, name, meta)


@dataclass
class PrefixCacheStats:
    """The prefix cache's counters (cumulative) and state, read by the server's metrics."""

    query_tokens: int = 0         # prompt tokens looked up
    hit_tokens: int = 0           # of those, served from cached blocks (memory or disk)
    disk_hit_tokens: int = 0      # of the hits, read back from the disk store
    blocks_idle: int = 0          # cached blocks no sequence holds (reusable or evictable)
    blocks_cached: int = 0        # blocks with a name (held or idle)
    evictions: int = 0            # idle blocks reused for other rows
    disk: object = None           # kv_store_disk.DiskStats, or None without a disk store

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass
class Hit:
    """The cached start of a sequence: blocks in memory, then blocks to read from disk."""

    blocks: list[int] = field(default_factory=list)       # held, in memory
    disk: list[bytes] = field(default_factory=list)       # names to load after them
    importance: np.ndarray | None = None                  # float32[n_layers, n_blocks] (sparse)
    # Under sparse attention, the memory blocks up to the last one with importance: where the
    # hit falls back to if the disk part cannot be read.
    memory_usable: int = 0
    loaded: list = field(default_factory=list)            # BlockMeta of the disk blocks read so far

    @property
    def n_blocks(self) -> int:
        return len(self.blocks) + len(self.disk)


class PrefixCache:
    """Names, finds and shares full blocks of one PagedKVCache; spills them to a DiskStore.

    sparse_k: None under exact attention; under block-sparse attention its k, which says up
    to which block decode rows are computed as a prefill would compute them.
    """

    def __init__(self, cache, root: bytes, sparse_k: int | None = None, store=None):
        self.cache = cache
        self.pool: BlockPool = cache.pool
        self.root = root
        self.sparse_k = sparse_k
        self.store = store
        self.query_tokens = 0
        self.hit_tokens = 0
        self.disk_hit_tokens = 0
        # Named blocks the disk store may lack, oldest first (with a store only).
        self._unsaved: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.pool.on_evict = self._spill

    @property
    def needs_importance(self) -> bool:
        return self.sparse_k is not None

    # ---- names ---------------------------------------------------------------
    def names(self, blocks, tokens, extras, n_full: int) -> list[bytes]:
        """blocks.names extended to the first n_full full blocks of `tokens`.
        extras(j) -> bytes: what besides token ids block j holds (image content), or b""."""
        bs = self.cache.block_size
        names = blocks.names
        parent = names[-1] if names else self.root
        for j in range(len(names), n_full):
            parent = block_hash(parent, tokens[j * bs:(j + 1) * bs], extras(j))
            names.append(parent)
        return names

    # ---- lookup --------------------------------------------------------------
    def match(self, names: list[bytes], limit: int) -> Hit:
        """The longest cached start among the first `limit` names (memory, then disk); blocks
        found in memory are held for the caller. Under sparse attention it ends at a block
        that carries the importance of its prefix."""
        hit = Hit()
        usable = 0                               # blocks of the hit a sequence may start from
        for j in range(limit):
            block = self.pool.lookup(names[j])
            if block is None:
                break
            hit.blocks.append(block)
            if not self.needs_importance or self.pool.meta[block].importance is not None:
                usable = j + 1
        hit.memory_usable = usable
        if self.store is not None:
            for j in range(len(hit.blocks), limit):
                found = self.store.find(names[j])
                if found is None:
                    break
                hit.disk.append(names[j])
                if not self.needs_importance or found.importance:
                    usable = j + 1
        del hit.disk[max(0, usable - len(hit.blocks)):]
        del hit.blocks[usable:]
        if hit.blocks and not hit.disk and self.needs_importance:
            hit.importance = self.pool.meta[hit.blocks[-1]].importance
        for block in hit.blocks:
            self.pool.hold(block)
        return hit

    def count_query(self, query_tokens: int, hit_tokens: int, disk_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens
        self.disk_hit_tokens += disk_tokens

    def load(self, names: list[bytes], blocks: list[int], tokens, parent: bytes) -> list:
        """Read blocks named `names` from disk into pool blocks `blocks`, in order, up to the
        first that is missing or rejected. Returns the BlockMeta of each one read."""
        read = []
        for name, block in zip(names, blocks):
            j = len(read)
            meta = self.store.load(name, parent, tokens[j], self.cache.block_view(block))
            if meta is None:
                break
            read.append(meta)
            parent = name
        return read

    # ---- registration ----------------------------------------------------------
    def cacheable(self, index: int, computed_by_prefill: bool) -> bool:
        """May block `index`, once full, be found by other sequences? Always under exact
        attention; under sparse attention when a cold prefill would compute the same rows."""
        return self.sparse_k is None or computed_by_prefill or index < self.sparse_k

    def register(self, block: int, name: bytes, parent: bytes, tokens,
                 importance: np.ndarray | None = None) -> bool:
        meta = BlockMeta(parent, np.array(tokens, dtype=np.int32), importance)
        if not self.pool.register(block, name, meta):
            return False
        if self.store is not None:
            self._unsaved[name] = None
        return True

    def add_importance(self, name: bytes, importance: np.ndarray) -> None:
        """The prefix importance at the end of block `name` (a prefill chunk ended there), for
        the cached block of that name, whichever sequence's it is."""
        block = self.pool.lookup(name)
        if block is not None and self.pool.meta[block].importance is None:
            self.pool.meta[block].importance = importance
            if self.store is not None:
                self._unsaved[name] = None
                self._unsaved.move_to_end(name)

    # ---- disk ------------------------------------------------------------------
    def _spill(self, block: int, name: bytes, meta: BlockMeta) -> None:
        """An idle block is about to be reused: keep a copy on disk (the writer thread writes it)."""
        if self.store is not None and self._unsaved.pop(name, 0) is None:
            self.store.save(name, meta, self.cache.block_copy(block))

    def persist(self, limit: int | None = None) -> int:
        """Queue up to `limit` named blocks the disk lacks, the most recently named first (so that
        the freshest conversations are kept when time runs out); returns how many were queued.
        The server calls it when idle and at shutdown: a restart then finds its cache on disk."""
        if self.store is None:
            return 0
        queued = 0
        while self._unsaved and (limit is None or queued < limit):
            name, _ = self._unsaved.popitem(last=True)
            block = self.pool.lookup(name)
            if block is None:
                continue
            meta = self.pool.meta[block]
            if self.store.wants(name, meta):
                if not self.store.save(name, meta, self.cache.block_copy(block)):
                    self._unsaved[name] = None      # the writer is behind: later
                    break
                queued += 1
        return queued

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(query_tokens=self.query_tokens, hit_tokens=self.hit_tokens,
                                disk_hit_tokens=self.disk_hit_tokens, blocks_idle=len(self.pool.idle),
                                blocks_cached=len(self.pool.hash_of), evictions=self.pool.evictions,
                                disk=None if self.store is None else self.store.stats())
