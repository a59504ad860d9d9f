/*
 * Block-sparse attention helpers (ENGINE.md, "Block-sparse attention"): the probe that
 * scores KV blocks, and the block choice. (The importance each prefill token receives comes
 * out of the attention pass: kernels.h attention_importance_*.) Cache layouts and the
 * (table, blockpos, count) block lists are those of kernels.h.
 *
 * Plain C compiled with the build's arch flags, tested against numpy
 * (tests/kernels/test_sparse_kernels.py). The engine probes with kernels.h's
 * attention_probe_{simd,portable}, built on the attention score primitives (2.1x faster
 * than this file's per-row dots at 8K context); sparse_probe is their reference.
 */
#ifndef APPLIANCE_SPARSE_H
#define APPLIANCE_SPARSE_H
#include <stdint.h>

enum { SPARSE_KV_Q8 = 0, SPARSE_KV_Q4 = 1, SPARSE_KV_F32 = 2 };

/* scores float[n_kv, nblocks]: for kv head h and listed block i (table[i] physical, count[i]
 * valid rows), the max over query rows r < R, over the group's query heads, and over the
 * sampled rows j = 0, step, 2*step, ... < count[i] (step = max(1, count[i] / probe)) of
 * scale * q[r, h*group + g] . K[row j]. For q8/q4 the query is first quantized to int8 per
 * 32-block (as in attention), K is used without dequantizing. q float[R, n_kv*group, hd]. */
void sparse_probe(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group, int64_t hd,
                  const void *k, const float *ks, int64_t bs, const int32_t *table,
                  const int32_t *count, int64_t nblocks, int64_t probe, float scale,
                  float *scores, int nthreads);

/* The same scores, reading the sampled rows of full blocks (count == bs) from a compact copy:
 * pk/pks are laid out like a cache layer with pbs rows per (block, kv head) slab, row jj of a
 * slab holding row jj * (bs / probe) of the cache's slab (the cache writes it; see
 * PagedKVCache.enable_probe_rows). The sampled rows of a full block are then one contiguous
 * run instead of every step-th row of a 4 KB slab: the probe reads pbs / bs of K's bytes,
 * where striding through the slab made the hardware fetch nearly all of them. Blocks that are
 * not full are read from the cache as in sparse_probe. Same values, so the same scores, bit
 * for bit. Needs bs / probe >= 1 and pbs = ceil(bs / (bs / probe)). */
void sparse_probe_compact(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group, int64_t hd,
                          const void *k, const float *ks, int64_t bs, const void *pk, const float *pks,
                          int64_t pbs, const int32_t *table, const int32_t *count, int64_t nblocks,
                          int64_t probe, float scale, float *scores, int nthreads);

/* Block choice of ENGINE.md for one decode step (the C twin of appliance.sparse.select_blocks):
 * chosen uint8[n_kv, nb] from scores float[n_kv, nb] and importance float[nb] (NULL: none).
 * k >= nb: all. Otherwise the (k+1)/2 most important blocks (if any importance is > 0) are
 * kept for every head, the rest of the budget goes to each head's best scores, ties to the
 * lower index, and the last block is always in (replacing the lowest-scoring pick). */
void sparse_select(const float *scores, int64_t n_kv, int64_t nb, const float *importance, int64_t k,
                   uint8_t *chosen);

#endif
