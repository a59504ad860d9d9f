/*
 * Block-sparse attention helpers (ENGINE.md, "Block-sparse attention"): the probe that
 * scores KV blocks and the importance each prefill token receives. Cache layouts and the
 * (table, blockpos, count) block lists are those of kernels.h.
 *
 * Plain C compiled with the build's arch flags; there is no hand-written SIMD twin (the
 * loops are short int8 dots the compiler vectorises), so this file is its own reference
 * and its tests compare it with numpy (tests/kernels/test_sparse_kernels.py).
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

/* importance float[n_positions] += for every query t < T and query head, the softmax weight
 * (over the listed rows it can see: position <= qpos[t]) of each row, added at the row's
 * position blockpos*bs + offset. Per kv head h the rows are those of table[h*stride + i],
 * i < nsel (stride 0: one list for all heads). q float[T, n_kv*group, hd]. */
void sparse_importance(int kind, const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                       const void *k, const float *ks, int64_t bs, const int32_t *table,
                       const int32_t *blockpos, const int32_t *count, int64_t nsel,
                       int64_t table_stride, const int32_t *qpos, float scale,
                       float *importance, int64_t n_positions, int nthreads);

#endif
