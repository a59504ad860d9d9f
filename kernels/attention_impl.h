/*
 * The attention kernels of kernels.h, shared by every path: a C "template" made of the one-pass
 * driver (attention_driver.h) and the two probes of block-sparse attention (attention_probe.h).
 *
 * The including file defines ATTN_NAME(x) (x##_portable or x##_simd) and these static
 * primitives, then includes this header once:
 *
 *   attn_quantize_q(q float[rows, hd], rows, hd, qq int8[2, rows, hd], qd float[rows, hd/QK])
 *       qq[0], qd exactly quantize_rows_q8; qq[1] is the path's to fill (e.g. |qq[0]|);
 *   attn_scores_{q8,q4,f32}(query, rows, hd, k rows, k scales, n, scale, s float[rows, ld], ld)
 *       s[r, j] = score of query row r against key row j (already times `scale`);
 *       q4 also gets work int8[bs, hd], scratch for unpacked rows;
 *   attn_accum_{q8,q4,f32}(v rows, v scales, n, rows, hd, w float[rows, ld], ld, acc float[rows, hd])
 *       acc[r, :] += sum_j w[r, j] * dequant(v row j); w may be overwritten;
 *   attn_max(s, n) -> max_j s[j];   attn_exp_shift(s, n, m): s[j] = exp(s[j] - m), returns the sum;
 *   attn_scale(x, n, r): x *= r.
 *
 * The kernels that use them record their team size (kernel_last_threads) and, out of memory,
 * write NaN where their results go rather than crash.
 */
#include <math.h>
#include <stdlib.h>
#include "topk.h"

/* Below this many K rows scanned in all, a kernel runs on the calling thread: a sleeping team
 * takes longer to wake up than such a scan. */
#define ATTN_PARALLEL_MIN_ROWS 256

/* A thread's scratch, carved from one 64-byte aligned allocation. Each kernel lists its buffers
 * once, scratch_take for each, in a loop of two passes: the first (base NULL) only measures and
 * allocates that size, the second hands out the slices, 64-byte aligned. Out of memory, every
 * slice is NULL and the kernel writes NaN where its results go. */
typedef struct {
    unsigned char *base;
    size_t used;
} attn_scratch;

static inline void *scratch_take(attn_scratch *sc, size_t bytes)
{
    void *p = sc->base != NULL ? sc->base + sc->used : NULL;
    sc->used += (bytes + 63) & ~(size_t)63;
    return p;
}

/* NULL when out of memory (the layout then hands out NULL slices). */
static inline unsigned char *scratch_alloc(size_t bytes)
{
    void *base = NULL;
    return posix_memalign(&base, 64, bytes > 0 ? bytes : 64) == 0 ? (unsigned char *)base : NULL;
}

#include "attention_driver.h"
#include "attention_probe.h"
