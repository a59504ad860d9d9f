"""Paged KV cache: a pool of fixed-size blocks shared by all sequences.

Per layer the pool holds, head-major inside each block (bs = block_size tokens):
  q8 : k int8[nblk, n_kv, bs, hd],      k_scale float32[nblk, n_kv, bs]        (per token, head)
  q4 : k uint8[nblk, n_kv, bs, hd/2],   k_scale float32[nblk, n_kv, bs, hd/32] (Q4_0 blocks)
  f32: k float32[nblk, n_kv, bs, hd]    (a debugging probe)
and the same for V. All layers live in one array per field ([n_layers, ...]), made
with np.zeros so the OS commits pages only as blocks are first written.

A sequence holds a list of physical block ids (its block table); logical block i
holds positions [i*bs, (i+1)*bs). Full blocks can be shared by several sequences and
outlive them (prefix_cache.py): the pool's BlockPool counts who holds what.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from appliance.kernels import quant, reference
from appliance.kernels.dispatch import kernels
from appliance.options import KV_FORMATS
from appliance.errors import KVCacheFullError
from appliance.engine.prefix_cache import BlockPool


def bytes_per_token_per_layer(kind: str, n_kv: int, head_dim: int) -> int:
    """KV bytes one token costs in one layer (K and V with their scales)."""
    if kind == "q8":
        return 2 * n_kv * (head_dim + 4)
    if kind == "q4":
        return 2 * n_kv * (head_dim // 2 + 4 * (head_dim // quant.QK))
    if kind == "f32":
        return 2 * n_kv * head_dim * 4
    raise ValueError(f"unknown KV cache kind {kind!r} (choose from {', '.join(KV_FORMATS)})")


@dataclass
class PromptImportance:
    """The attention mass each prompt token received in a sparse prefill; block-sparse decode
    reserves the blocks that drew the most (engine/sparse.py)."""

    tokens: np.ndarray                 # float32[n_layers, prompt tokens], summed over queries and heads
    # float32[n_layers, n_blocks]: `tokens` summed per KV block (zero past the prompt), made once
    # when decode first reads it; summing the prompt every step cost 0.8 ms a token at 8K.
    block_sums: np.ndarray | None = None
    # float32[n_layers, cached blocks]: the mass the queries of a cached prefix gave its blocks
    # (prefix_cache.py); their rows were not computed again, so `tokens` lacks it.
    base: np.ndarray | None = None

    def prefix_block_sums(self, n_blocks: int, block_size: int) -> np.ndarray:
        """float32[n_layers, n_blocks]: the mass per block from the queries computed so far (and
        the cached prefix's), which is what a prefix of n_blocks full blocks carries to a later hit."""
        n = n_blocks * block_size
        if n > self.tokens.shape[1]:
            raise ValueError(f"{n_blocks} blocks reach past the prompt's {self.tokens.shape[1]} tokens")
        sums = self.tokens[:, :n].reshape(self.tokens.shape[0], n_blocks, block_size).sum(axis=2)
        if self.base is not None:
            sums[:, :self.base.shape[1]] += self.base
        return sums


@dataclass
class SequenceBlocks:
    """The KV blocks of one sequence and how many positions are filled."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0
    importance: PromptImportance | None = None   # recorded by a sparse prefill, else None
    # The prefix cache's view (engine/sequence_cache.py):
    names: list[bytes] = field(default_factory=list)   # hashes of the full blocks, in order
    registered: int = 0          # leading full blocks offered to the prefix cache so far
    cached_tokens: int = 0       # positions that came from the prefix cache at the last start
    prefill_to: int = 0          # positions prefill computes (the prompt; after a preemption, all
                                 # but the last generated token)
    pending: object = None       # prefix_cache.Hit while cached blocks are read from disk
    extras: object = None        # block index -> bytes of image content its hash includes

    def views(self, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(table, blockpos, count) int32 arrays for the attention kernels: the filled blocks in order.

        Blocks reserved ahead of `length` (a prompt's later chunks) are not listed.
        """
        n = -(-self.length // block_size)
        table = np.asarray(self.blocks[:n], dtype=np.int32)
        blockpos = np.arange(n, dtype=np.int32)
        count = np.full(n, block_size, dtype=np.int32)
        if n:
            count[-1] = self.length - (n - 1) * block_size
        return table, blockpos, count


@dataclass
class RowsBackup:
    """What positions [start, end) of a sequence held before a write that may be undone (the
    drafted rows of a speculative step), in every pool array, so that undoing the rows past the
    accepted ones leaves the pool as if they had never been written.

    rows[name]: [T, n_layers, n_kv, ...] the rows of k, v and their scales at those positions;
    probe[name]: the compact probe rows of the sampled positions among them (sampled: bool[T]);
    bounds[block]: the bound rows of blocks whose last position is in the range (a write there
    recomputes them), copies of bound_k[:, block] and bound_k_scale[:, block].
    """

    start: int
    blocks: np.ndarray                  # intp[T] physical block of each position
    offsets: np.ndarray                 # intp[T] position within its block
    rows: dict[str, np.ndarray]
    sampled: np.ndarray | None = None
    probe: dict[str, np.ndarray] = field(default_factory=dict)
    bounds: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


class PagedKVCache:
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, kind: str = "q8",
                 block_size: int = 32, capacity_tokens: int = 4096):
        if kind not in KV_FORMATS:
            raise ValueError(f"unknown KV cache kind {kind!r} (choose from {', '.join(KV_FORMATS)})")
        if kind == "q4" and head_dim % quant.QK:
            raise ValueError(f"q4 KV needs head_dim divisible by {quant.QK}, got {head_dim}")
        self.kind, self.n_layers, self.n_kv, self.head_dim = kind, n_layers, n_kv, head_dim
        self.block_size = block_size
        self.n_blocks = -(-capacity_tokens // block_size)
        shape = (n_layers, self.n_blocks, n_kv, block_size)
        if kind == "q8":
            self.k = np.zeros(shape + (head_dim,), np.int8)
            self.v = np.zeros(shape + (head_dim,), np.int8)
            self.k_scale = np.zeros(shape, np.float32)
            self.v_scale = np.zeros(shape, np.float32)
        elif kind == "q4":
            self.k = np.zeros(shape + (head_dim // 2,), np.uint8)
            self.v = np.zeros(shape + (head_dim // 2,), np.uint8)
            self.k_scale = np.zeros(shape + (head_dim // quant.QK,), np.float32)
            self.v_scale = np.zeros(shape + (head_dim // quant.QK,), np.float32)
        else:
            self.k = np.zeros(shape + (head_dim,), np.float32)
            self.v = np.zeros(shape + (head_dim,), np.float32)
            self.k_scale = self.v_scale = None
        self.pool = BlockPool(self.n_blocks)
        self.probe_k = self.probe_k_scale = None     # see enable_probe_rows
        self.probe_step = 0
        self.bound_k = self.bound_k_scale = None     # see enable_bound_rows

    def enable_probe_rows(self, probe: int) -> None:
        """Keep a compact copy of the K rows block-sparse attention probes in full blocks.

        The probe samples rows 0, step, 2*step, ... (step = block_size // probe) of every
        block; in place they are every step-th row of a 4 KB slab, and striding through them
        made the hardware fetch almost all of K (0.83 ms per layer at 8K context, as slow as
        reading it). The copy puts them side by side: probe_k[layer] is laid out like k[layer]
        with ceil(block_size / step) rows per slab, written with the same quantizer, so the
        scores are bit for bit those of the strided read. Costs 1/step of K's bytes.
        """
        step = self.block_size // probe if probe >= 1 else 0
        if step < 1:
            raise ValueError(f"probe must be between 1 and the block size {self.block_size}, not {probe}")
        rows = -(-self.block_size // step)
        self.probe_step = step
        self.probe_k = np.zeros(self.k.shape[:3] + (rows,) + self.k.shape[4:], self.k.dtype)
        if self.k_scale is not None:
            self.probe_k_scale = np.zeros(self.k_scale.shape[:3] + (rows,) + self.k_scale.shape[4:], np.float32)

    def enable_bound_rows(self) -> None:
        """Keep, per full block and kv head, the channel-wise maximum and minimum of its K rows.

        The bound probe of block-sparse attention (kernels.h attention_probe_bound) ranks blocks by
        q+ . max + q- . min, an upper bound of every q . K in the block, reading 2 rows of a block
        instead of its sampled ones. Stored as q8 rows (quant.quantize_bound_rows), written when a
        block's last position is: 2 * (hd + 4) bytes per block and kv head, 1/16 of K's at bs 32.
        """
        shape = (self.n_layers, self.n_blocks, self.n_kv, 2)
        self.bound_k = np.zeros(shape + (self.head_dim,), np.int8)
        self.bound_k_scale = np.zeros(shape, np.float32)

    def dequantized_k(self, layer: int, blocks: np.ndarray) -> np.ndarray:
        """float32[len(blocks), n_kv, bs, hd]: the K rows of these physical blocks as attention sees them."""
        ks = self.k_scale[layer][blocks] if self.k_scale is not None else None
        return quant.dequantize_kv(self.k[layer][blocks], ks, self.kind)

    def _write_bounds(self, layer: int, blocks: np.ndarray, offsets: np.ndarray) -> None:
        """Bound rows of the blocks whose last position this write filled."""
        full = np.unique(blocks[offsets == self.block_size - 1])
        if len(full):
            keys = self.dequantized_k(layer, full)
            bk, bks = quant.quantize_bound_rows(keys.max(axis=2), keys.min(axis=2))
            self.bound_k[layer][full] = bk
            self.bound_k_scale[layer][full] = bks

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's arrays (committed by the OS only as they are written)."""
        arrays = (self.k, self.v, self.k_scale, self.v_scale, self.probe_k, self.probe_k_scale,
                  self.bound_k, self.bound_k_scale)
        return sum(a.nbytes for a in arrays if a is not None)

    # ---- accounting -------------------------------------------------------
    @property
    def blocks_total(self) -> int:
        return self.n_blocks

    @property
    def blocks_used(self) -> int:
        """Blocks some sequence holds (idle cached blocks are not used: the pool takes them back)."""
        return self.pool.held

    @property
    def blocks_available(self) -> int:
        """Blocks a sequence can get now: free, or idle in the prefix cache."""
        return self.pool.available

    @property
    def capacity_tokens(self) -> int:
        return self.n_blocks * self.block_size

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V with their scales, plus the compact probe rows when sparse attention keeps them."""
        base = bytes_per_token_per_layer(self.kind, self.n_kv, self.head_dim)
        extra = 0
        if self.probe_k is not None:
            rows = self.probe_k.shape[3]                 # copied rows per block
            extra += round((base // 2) * rows / self.block_size)    # that share of K (half of base)
        if self.bound_k is not None:
            extra += round(2 * self.n_kv * (self.head_dim + 4) / self.block_size)
        return base + extra

    def blocks_needed(self, seq: SequenceBlocks, new_length: int) -> int:
        return max(0, -(-new_length // self.block_size) - len(seq.blocks))

    # ---- allocation -------------------------------------------------------
    def reserve(self, seq: SequenceBlocks, new_length: int, keep_available: int = 0) -> None:
        """Make sure `seq` has blocks for `new_length` positions (all or nothing), leaving at
        least `keep_available` blocks for others."""
        need = self.blocks_needed(seq, new_length)
        if need + keep_available > self.pool.available:
            raise KVCacheFullError(f"KV cache full: {need} more blocks needed, {self.pool.available} available "
                                   f"of {self.n_blocks}" + (f" ({keep_available} kept for running sequences)"
                                                            if keep_available else ""))
        for _ in range(need):
            seq.blocks.append(self.pool.take())

    def release(self, seq: SequenceBlocks) -> None:
        """Give the sequence's blocks back: named ones stay in the prefix cache, idle."""
        for block in reversed(seq.blocks):
            self.pool.drop(block)
        seq.blocks.clear()
        seq.length = 0
        seq.importance = None
        seq.registered = 0

    # ---- whole blocks (the prefix cache's disk tier) ----------------------------
    def _block_arrays(self) -> dict[str, np.ndarray]:
        """Every per-block array of the pool, [n_layers, n_blocks, ...] each."""
        arrays = {"k": self.k, "v": self.v, "k_scale": self.k_scale, "v_scale": self.v_scale,
                  "probe_k": self.probe_k, "probe_k_scale": self.probe_k_scale,
                  "bound_k": self.bound_k, "bound_k_scale": self.bound_k_scale}
        return {name: a for name, a in arrays.items() if a is not None}

    def block_layout(self) -> dict[str, tuple[np.dtype, tuple]]:
        """{array: (dtype, shape of one block's part)}: what a stored block must hold."""
        return {name: (a.dtype, (a.shape[0],) + a.shape[2:]) for name, a in self._block_arrays().items()}

    def block_view(self, block: int) -> dict[str, np.ndarray]:
        """Writable views of one physical block in every array."""
        return {name: a[:, block] for name, a in self._block_arrays().items()}

    def block_copy(self, block: int) -> dict[str, np.ndarray]:
        return {name: a[:, block].copy() for name, a in self._block_arrays().items()}

    # ---- undoing a write (speculative decoding's rejected rows) ----------------
    def save_rows(self, seq: SequenceBlocks, start: int, end: int) -> RowsBackup:
        """What positions [start, end) of `seq` hold now (its blocks must reach `end`)."""
        bs = self.block_size
        pos = np.arange(start, end)
        blocks = np.asarray(seq.blocks, dtype=np.intp)[pos // bs]
        offsets = pos % bs
        arrays = {"k": self.k, "v": self.v, "k_scale": self.k_scale, "v_scale": self.v_scale}
        backup = RowsBackup(start, blocks, offsets,
                            {name: a[:, blocks, :, offsets] for name, a in arrays.items() if a is not None})
        if self.probe_k is not None:
            backup.sampled = offsets % self.probe_step == 0
            pb, prow = blocks[backup.sampled], offsets[backup.sampled] // self.probe_step
            backup.probe["probe_k"] = self.probe_k[:, pb, :, prow]
            if self.probe_k_scale is not None:
                backup.probe["probe_k_scale"] = self.probe_k_scale[:, pb, :, prow]
        if self.bound_k is not None:
            for block in blocks[offsets == bs - 1]:
                backup.bounds[int(block)] = (self.bound_k[:, block].copy(), self.bound_k_scale[:, block].copy())
        return backup

    def undo_rows(self, seq: SequenceBlocks, backup: RowsBackup, length: int, keep_blocks: int) -> None:
        """Put back what positions from `length` on held before the write `backup` was taken for,
        and give the pool the blocks past max(keep_blocks, those `length` positions fill), newest
        first, so the pool's free list is as it was."""
        undo = backup.start + np.arange(len(backup.blocks)) >= length
        if undo.any():
            blocks, offsets = backup.blocks[undo], backup.offsets[undo]
            for name, rows in backup.rows.items():
                getattr(self, name)[:, blocks, :, offsets] = rows[undo]
            if backup.sampled is not None:
                sampled = backup.sampled & undo
                kept = undo[backup.sampled]
                pb, prow = backup.blocks[sampled], backup.offsets[sampled] // self.probe_step
                for name, rows in backup.probe.items():
                    getattr(self, name)[:, pb, :, prow] = rows[kept]
            for block in blocks[offsets == self.block_size - 1] if self.bound_k is not None else ():
                self.bound_k[:, block], self.bound_k_scale[:, block] = backup.bounds[int(block)]
        keep = max(keep_blocks, -(-length // self.block_size))
        while len(seq.blocks) > keep:
            self.pool.drop(seq.blocks.pop())
        seq.length = length

    # ---- writes -----------------------------------------------------------
    def write(self, layer: int, seq: SequenceBlocks, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v float32[T, n_kv, hd] at positions start..start+T-1 of `seq` in `layer`."""
        self._store(kernels, layer, seq, start, k, v)
        self._write_bounds_filled(layer, seq, start, k.shape[0])

    def batch_slots(self, parts: list[tuple[SequenceBlocks, int, int]]) -> np.ndarray:
        """int32 slots (block * block_size + offset) of the rows of parts [(seq, start, rows)], in
        order: where write_batch stores them, the same in every layer of a step."""
        return np.concatenate([self._slots(seq, start, t)[1] for seq, start, t in parts]).astype(np.int32, copy=False)

    def _slots(self, seq: SequenceBlocks, start: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, slots) int32 of positions start..start+t-1 of `seq`."""
        bs = self.block_size
        pos = np.arange(start, start + t)
        if t == 1:   # decode: skip turning the whole block list into an array, once per layer
            blocks = np.array([seq.blocks[start // bs]], dtype=np.int32)
        else:
            blocks = np.asarray(seq.blocks, dtype=np.int32)[pos // bs]
        return blocks, blocks * bs + (pos % bs).astype(np.int32)

    def write_batch(self, layer: int, parts: list[tuple[SequenceBlocks, int, int]], slots: np.ndarray,
                    k: np.ndarray, v: np.ndarray) -> None:
        """`write` for several sequences at once: k, v float32[M, n_kv, hd] hold the rows of parts
        [(seq, start, rows)] in order, `slots` is batch_slots(parts). One store each for K and V
        (a decode step of a batch paid two calls per sequence and layer); the probe rows and the
        bounds of filled blocks, where the cache keeps them, per part as `write` does."""
        ks = self.k_scale[layer] if self.k_scale is not None else None
        vs = self.v_scale[layer] if self.v_scale is not None else None
        kernels.kv_store(self.kind, k, slots, self.k[layer], ks)
        kernels.kv_store(self.kind, v, slots, self.v[layer], vs)
        if self.probe_k is None and self.bound_k is None:
            return
        row = 0
        for seq, start, t in parts:
            if self.probe_k is not None:
                self._store_probe(kernels, layer, seq, start, k[row:row + t])
            self._write_bounds_filled(layer, seq, start, t)
            row += t

    def _write_bounds_filled(self, layer: int, seq: SequenceBlocks, start: int, t: int) -> None:
        """The bound rows of the blocks that rows start..start+t-1 filled up, if any."""
        bs = self.block_size
        if self.bound_k is not None and (start + t) // bs > start // bs:
            pos = np.arange(start, start + t)
            blocks = np.asarray(seq.blocks, dtype=np.intp)[pos // bs]
            self._write_bounds(layer, blocks, pos % bs)

    def write_reference(self, layer: int, seq: SequenceBlocks, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """`write` through the kernels' numpy twin (reference.kv_store: appliance.kernels.quant's
        formats), whatever dispatch chose: what the compiled writes are held to."""
        self._store(reference, layer, seq, start, k, v)

    def _store(self, ops, layer: int, seq: SequenceBlocks, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """K, V and the compact probe rows through `ops.kv_store` (the compiled kernels or their twin)."""
        blocks, slots = self._slots(seq, start, k.shape[0])
        ks = self.k_scale[layer] if self.k_scale is not None else None
        vs = self.v_scale[layer] if self.v_scale is not None else None
        ops.kv_store(self.kind, k, slots, self.k[layer], ks)
        ops.kv_store(self.kind, v, slots, self.v[layer], vs)
        if self.probe_k is not None:
            self._store_probe(ops, layer, seq, start, k, blocks)

    def _store_probe(self, ops, layer: int, seq: SequenceBlocks, start: int, k: np.ndarray,
                     blocks: np.ndarray | None = None) -> None:
        """The sampled keys of rows start..start+T-1 into the compact probe rows."""
        t = k.shape[0]
        bs = self.block_size
        if t == 1 and (start % bs) % self.probe_step != 0:
            return
        pos = np.arange(start, start + t)
        if blocks is None:
            blocks = np.asarray(seq.blocks, dtype=np.int32)[pos // bs]
        offset = pos % bs
        sampled = offset % self.probe_step == 0
        if sampled.any():
            rows = self.probe_k.shape[3]
            pslots = blocks[sampled] * rows + (offset[sampled] // self.probe_step).astype(np.int32)
            pks = self.probe_k_scale[layer] if self.probe_k_scale is not None else None
            ops.kv_store(self.kind, np.ascontiguousarray(k[sampled]), pslots, self.probe_k[layer], pks)
