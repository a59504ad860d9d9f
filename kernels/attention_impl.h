/*
 * The one-pass attention driver, shared by every path: a C "template".
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
 * Blocked online softmax: per listed KV block, the scores of its visible rows are computed
 * for all query rows of the unit (up to ATTN_QTILE queries x the kv head's group), each
 * row's running max is raised once for the block (one rescale of acc and of the sum), then
 * V rows are read once and accumulated for all rows. Every K and V row is read exactly
 * once per (tile of queries, kv head): once per query head group in decode.
 *
 * Importance (block-sparse prefill, ENGINE.md): with `importance` set, the same pass also adds
 * to importance[position] the softmax weight every query head gives every listed row. Each
 * block's exp-shifted scores are kept with the running max they were shifted by, so the final
 * weight is one multiply per score, not a second scoring pass. Units write their sums to their
 * own slice and the slices are added in unit order: the result does not depend on the threads.
 */
#include <math.h>
#include <stdlib.h>
#include "topk.h"

enum { ATTN_KV_Q8, ATTN_KV_Q4, ATTN_KV_F32 };

#define ATTN_PARALLEL_MIN_ROWS 2048
#define ATTN_QTILE 4   /* queries per work unit */

/* Block tables are scattered over the cache, so no hardware prefetcher can guess the next
 * slab: ask for its K and V rows while the current one is computed. */
static inline void prefetch_rows(int kind, const void *kv, const float *scales, int64_t row0,
                                 int64_t bs, int64_t hd)
{
    const int64_t row_bytes = kind == ATTN_KV_Q8 ? hd : kind == ATTN_KV_Q4 ? hd / 2 : hd * 4;
    const char *p = (const char *)kv + row0 * row_bytes;
    for (int64_t off = 0; off < bs * row_bytes; off += 64)
        __builtin_prefetch(p + off);
    if (scales != NULL) {
        const int64_t per_row = kind == ATTN_KV_Q4 ? hd / QK : 1;
        const char *sp = (const char *)(scales + row0 * per_row);
        for (int64_t off = 0; off < bs * per_row * (int64_t)sizeof(float); off += 64)
            __builtin_prefetch(sp + off);
    }
}

/* One unit's importance: contrib[i*bs + j] = sum over its rows r of the final softmax weight of
 * listed block i's row j, i.e. kept weight * exp(shift - final max) / final sum. Rows are
 * added in order, so the sums are the same on every run. Entries a row never saw stay 0. */
static void ATTN_NAME(importance_unit)(const float *wkeep, const float *shift, const float *mx,
                                       const float *sum, int64_t rows, int64_t nsel, int64_t bs,
                                       int64_t list0, const int32_t *blockpos, const int32_t *count,
                                       const int32_t *qpos, int64_t group, int64_t per_unit,
                                       float *contrib)
{
    memset(contrib, 0, (size_t)per_unit * sizeof(float));
    for (int64_t r = 0; r < rows; r++) {
        if (!(sum[r] > 0.0f))
            continue;                 /* a query that saw no row gives no weight */
        const float inv = 1.0f / sum[r];
        for (int64_t i = 0; i < nsel; i++) {
            const float sh = shift[r * nsel + i];
            if (sh == -INFINITY)
                continue;
            const int64_t upto = (int64_t)qpos[r / group] - (int64_t)blockpos[list0 + i] * bs + 1;
            const int64_t n = count[list0 + i] < upto ? count[list0 + i] : upto;
            const float f = expf(sh - mx[r]) * inv;
            const float *w = wkeep + r * per_unit + i * bs;
            float *c = contrib + i * bs;
            for (int64_t j = 0; j < n; j++)
                c[j] += w[j] * f;
        }
    }
}

static void ATTN_NAME(attention_run)(int kind, const float *q, int64_t T, int64_t n_kv, int64_t group,
                                     int64_t hd, const void *k, const float *ks, const void *v,
                                     const float *vs, int64_t bs, const int32_t *table,
                                     const int32_t *blockpos, const int32_t *count, int64_t nsel,
                                     int64_t table_stride, const int32_t *qpos, float scale,
                                     float *out, float *importance, int64_t n_positions, int nthreads)
{
    const int64_t nb = hd / QK;
    const int64_t Hq = n_kv * group;
    /* Work unit: a tile of up to ATTN_QTILE consecutive queries x one kv head. Its
     * rows = qt * group query heads share every K and V row read: prefill reads the cache
     * once per tile instead of once per query. A row's arithmetic does not depend on the
     * tile (rows past a query's visible end get weight exactly 0), so results equal a
     * query-by-query scan bit for bit. */
    const int64_t qtile = T < ATTN_QTILE ? T : ATTN_QTILE;
    const int64_t ntiles = (T + qtile - 1) / qtile;
    const int64_t R = qtile * group;           /* query rows per unit, at most */
    const int64_t nunits = ntiles * n_kv;
    if (nunits <= 0)
        return;
    int nt = kernels_threads(nthreads);
    if (nt > nunits)
        nt = (int)nunits;
    /* Short scans (a few thousand rows in all) finish before a sleeping team wakes up. */
    if (T * n_kv * nsel * bs < ATTN_PARALLEL_MIN_ROWS)
        nt = 1;

    /* Row geometry of one (block, kv head) slab of the cache: bs rows. */
    const int64_t row_elems = hd;                               /* elements per K/V row */
    const int64_t scales_per_row = kind == ATTN_KV_Q4 ? nb : 1; /* q8: per row, q4: per 32-block */

    /* Scratch, per thread, once per call (64-byte aligned slices):
     *   qf float[R, hd] (the unit's query rows, gathered), qq int8[2, R, hd], qd float[R, nb],
     *   acc float[R, hd], s float[R, ld] (scores, then softmax weights),
     *   m/l float[R] (running max, sum), work int8[bs, hd]. */
    const int64_t ld = (bs + 15) & ~(int64_t)15;
    const size_t a64 = 63;
    const size_t sz_qf = ((size_t)R * hd * sizeof(float) + a64) & ~a64;
    const size_t sz_qq = ((size_t)2 * R * hd + a64) & ~a64;
    const size_t sz_qd = ((size_t)R * nb * sizeof(float) + a64) & ~a64;
    const size_t sz_acc = ((size_t)R * hd * sizeof(float) + a64) & ~a64;
    const size_t sz_s = ((size_t)R * ld * sizeof(float) + a64) & ~a64;
    const size_t sz_ml = ((size_t)R * sizeof(float) + a64) & ~a64;
    const size_t sz_work = (size_t)bs * hd;
    /* Importance only: kept weights w float[R, nsel*bs], the max each block was shifted by
     * shift float[R, nsel], and per unit contrib float[nsel*bs] in a wave of units. */
    const int64_t per_unit = nsel * bs;
    const size_t sz_w = importance ? ((size_t)R * per_unit * sizeof(float) + a64) & ~a64 : 0;
    const size_t sz_shift = importance ? ((size_t)R * nsel * sizeof(float) + a64) & ~a64 : 0;
    const size_t scratch = sz_qf + sz_qq + sz_qd + sz_acc + sz_s + 2 * sz_ml + sz_w + sz_shift + sz_work;
    /* Units per wave: their contrib slices take at most 8 MB, whatever the thread count. */
    int64_t wave = nunits;
    float *contrib = NULL;
    if (importance != NULL) {
        const int64_t cap = ((int64_t)1 << 21) / (per_unit > 0 ? per_unit : 1);
        wave = cap < 1 ? 1 : cap < nunits ? cap : nunits;
        contrib = malloc((size_t)(wave * per_unit) * sizeof(float));
        if (contrib == NULL) {   /* out of memory: NaN importance, still the right output */
            for (int64_t i = 0; i < n_positions; i++)
                importance[i] = NAN;
            importance = NULL;
            wave = nunits;
        }
    }

    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        unsigned char *base = NULL;
        if (posix_memalign((void **)&base, 64, scratch) != 0)
            base = NULL;
        unsigned char *p = base;
        float *qf = (float *)p;                p += sz_qf;
        int8_t *qq = (int8_t *)p;              p += sz_qq;
        float *qd = (float *)p;                p += sz_qd;
        float *acc = (float *)p;               p += sz_acc;
        float *s = (float *)p;                 p += sz_s;
        float *mx = (float *)p;                p += sz_ml;
        float *sum = (float *)p;               p += sz_ml;
        float *wkeep = (float *)p;             p += sz_w;
        float *shift = (float *)p;             p += sz_shift;
        int8_t *work = (int8_t *)p;

        /* Kv head major: consecutive units (on every thread) scan the same head's rows. Within
         * a head the latest queries, which see the most rows, go first, so the dynamic
         * schedule ends on short units. */
        for (int64_t w0 = 0; w0 < nunits; w0 += wave) {   /* one wave unless importance is kept */
        const int64_t w1 = w0 + wave < nunits ? w0 + wave : nunits;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t unit = w0; unit < w1; unit++) {
            const int64_t h = unit / ntiles;
            const int64_t t1 = T - (unit % ntiles) * qtile;          /* queries [t0, t1) */
            const int64_t t0 = t1 - qtile > 0 ? t1 - qtile : 0;
            const int64_t qt = t1 - t0;
            const int64_t rows = qt * group;   /* row r: query t0 + r / group, head h*group + r % group */
            if (base == NULL) {   /* out of memory: fail loudly in the numbers, not in a crash */
                for (int64_t tt = 0; tt < qt; tt++)
                    for (int64_t i = 0; i < group * hd; i++)
                        out[((t0 + tt) * Hq + h * group) * hd + i] = NAN;
                if (importance != NULL)
                    for (int64_t i = 0; i < per_unit; i++)
                        contrib[(unit - w0) * per_unit + i] = NAN;
                continue;
            }
            for (int64_t tt = 0; tt < qt; tt++)
                memcpy(qf + tt * group * hd, q + ((t0 + tt) * Hq + h * group) * hd,
                       (size_t)(group * hd) * sizeof(float));
            if (kind != ATTN_KV_F32)
                attn_quantize_q(qf, rows, hd, qq, qd);
            for (int64_t r = 0; r < rows; r++) {
                mx[r] = -INFINITY;
                sum[r] = 0.0f;
            }
            memset(acc, 0, (size_t)(rows * hd) * sizeof(float));
            if (importance != NULL)
                for (int64_t r = 0; r < rows * nsel; r++)
                    shift[r] = -INFINITY;   /* block never scored for this row: weight 0 */

            for (int64_t i = 0; i < nsel; i++) {
                const int64_t idx = h * table_stride + i;
                const int64_t p0 = (int64_t)blockpos[idx] * bs;
                int64_t vis[ATTN_QTILE];   /* rows of this block visible to each query */
                int64_t n = 0;             /* ... to any of them */
                for (int64_t tt = 0; tt < qt; tt++) {
                    int64_t c = count[idx];
                    const int64_t upto = (int64_t)qpos[t0 + tt] - p0 + 1;
                    if (upto < c)
                        c = upto;
                    vis[tt] = c > 0 ? c : 0;
                    n = vis[tt] > n ? vis[tt] : n;
                }
                if (n <= 0)
                    continue;
                const int64_t row0 = ((int64_t)table[idx] * n_kv + h) * bs;  /* first row of the slab */
                /* K of the next listed block now, its V after this block's scores. (Prefetching 2, 4
                 * or 8 blocks ahead, or into L2 only, measured the same at 4K context, cold: the
                 * scan is not waiting on the next slab's first lines.) */
                const int64_t next0 = i + 1 < nsel ? ((int64_t)table[idx + 1] * n_kv + h) * bs : -1;
                if (next0 >= 0)
                    prefetch_rows(kind, k, ks, next0, bs, hd);

                if (kind == ATTN_KV_Q8)
                    attn_scores_q8(qq, qd, rows, hd, (const int8_t *)k + row0 * row_elems,
                                   ks + row0, n, scale, s, ld);
                else if (kind == ATTN_KV_Q4)
                    attn_scores_q4(qq, qd, rows, hd, (const uint8_t *)k + row0 * row_elems / 2,
                                   ks + row0 * scales_per_row, n, scale, s, ld, work);
                else
                    attn_scores_f32(qf, rows, hd, (const float *)k + row0 * row_elems, n, scale, s, ld);

                for (int64_t r = 0; r < rows; r++) {
                    float *sr = s + r * ld;
                    const int64_t nr = vis[r / group];
                    if (nr > 0) {
                        const float bmax = attn_max(sr, nr);
                        if (bmax > mx[r]) {
                            if (mx[r] > -INFINITY) {   /* nothing accumulated yet otherwise */
                                const float f = expf(mx[r] - bmax);
                                sum[r] *= f;
                                attn_scale(acc + r * hd, hd, f);
                            }
                            mx[r] = bmax;
                        }
                        sum[r] += attn_exp_shift(sr, nr, mx[r]);
                    }
                    for (int64_t j = nr; j < n; j++)   /* causally hidden from this query */
                        sr[j] = 0.0f;
                    if (importance != NULL && nr > 0) {
                        memcpy(wkeep + r * per_unit + i * bs, sr, (size_t)n * sizeof(float));
                        shift[r * nsel + i] = mx[r];
                    }
                }

                if (next0 >= 0)
                    prefetch_rows(kind, v, vs, next0, bs, hd);
                if (kind == ATTN_KV_Q8)
                    attn_accum_q8((const int8_t *)v + row0 * row_elems, vs + row0, n, rows, hd, s, ld, acc);
                else if (kind == ATTN_KV_Q4)
                    attn_accum_q4((const uint8_t *)v + row0 * row_elems / 2, vs + row0 * scales_per_row,
                                  n, rows, hd, s, ld, acc);
                else
                    attn_accum_f32((const float *)v + row0 * row_elems, n, rows, hd, s, ld, acc);
            }

            /* A query that sees no row gets zeros, not 0/0. */
            for (int64_t r = 0; r < rows; r++) {
                const float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f;
                float *o = out + ((t0 + r / group) * Hq + h * group + r % group) * hd;
                for (int64_t d = 0; d < hd; d++)
                    o[d] = acc[r * hd + d] * inv;
            }
            if (importance != NULL)
                ATTN_NAME(importance_unit)(wkeep, shift, mx, sum, rows, nsel, bs, h * table_stride,
                                           blockpos, count, qpos + t0, group, per_unit,
                                           contrib + (unit - w0) * per_unit);
        }
        if (importance != NULL) {
            /* The implicit barrier above ends the wave; one thread adds its slices in unit order. */
            #pragma omp single
            for (int64_t unit = w0; unit < w1; unit++) {
                const float *c = contrib + (unit - w0) * per_unit;
                const int64_t h = unit / ntiles;
                for (int64_t i = 0; i < nsel; i++) {
                    const int64_t idx = h * table_stride + i;
                    const int64_t p0 = (int64_t)blockpos[idx] * bs;
                    for (int64_t j = 0; j < count[idx] && p0 + j < n_positions; j++)
                        importance[p0 + j] += c[i * bs + j];
                }
            }
        }
        }   /* waves */
        free(base);
    }
    free(contrib);
}

void ATTN_NAME(attention_q8)(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                             const int8_t *k, const float *ks, const int8_t *v, const float *vs,
                             int64_t bs, const int32_t *table, const int32_t *blockpos,
                             const int32_t *count, int64_t nsel, int64_t table_stride,
                             const int32_t *qpos, float scale, float *out, int nthreads)
{
    ATTN_NAME(attention_run)(ATTN_KV_Q8, q, T, n_kv, group, hd, k, ks, v, vs, bs, table, blockpos,
                             count, nsel, table_stride, qpos, scale, out, NULL, 0, nthreads);
}

void ATTN_NAME(attention_q4)(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                             const uint8_t *k, const float *ks, const uint8_t *v, const float *vs,
                             int64_t bs, const int32_t *table, const int32_t *blockpos,
                             const int32_t *count, int64_t nsel, int64_t table_stride,
                             const int32_t *qpos, float scale, float *out, int nthreads)
{
    ATTN_NAME(attention_run)(ATTN_KV_Q4, q, T, n_kv, group, hd, k, ks, v, vs, bs, table, blockpos,
                             count, nsel, table_stride, qpos, scale, out, NULL, 0, nthreads);
}

void ATTN_NAME(attention_f32)(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                              const float *k, const float *v,
                              int64_t bs, const int32_t *table, const int32_t *blockpos,
                              const int32_t *count, int64_t nsel, int64_t table_stride,
                              const int32_t *qpos, float scale, float *out, int nthreads)
{
    ATTN_NAME(attention_run)(ATTN_KV_F32, q, T, n_kv, group, hd, k, NULL, v, NULL, bs, table,
                             blockpos, count, nsel, table_stride, qpos, scale, out, NULL, 0, nthreads);
}

void ATTN_NAME(attention_importance)(int kind, const float *q, int64_t T, int64_t n_kv, int64_t group,
                                     int64_t hd, const void *k, const float *ks, const void *v,
                                     const float *vs, int64_t bs, const int32_t *table,
                                     const int32_t *blockpos, const int32_t *count, int64_t nsel,
                                     int64_t table_stride, const int32_t *qpos, float scale,
                                     float *out, float *importance, int64_t n_positions, int nthreads)
{
    ATTN_NAME(attention_run)(kind, q, T, n_kv, group, hd, k, ks, v, vs, bs, table, blockpos, count,
                             nsel, table_stride, qpos, scale, out, importance, n_positions, nthreads);
}

/* ---- the probe of block-sparse attention ---------------------------------------------
 * Semantics: sparse_attention.h (sparse_probe_compact). Here the scores come from this path's
 * attn_scores_* primitive: a full block's sampled rows are one contiguous run of pbs rows in
 * the compact copy pk, scored in one call like a short slab, and so is a whole slab when every
 * row is sampled (step 1); other blocks score their sampled rows one at a time. Parallel over
 * kv heads. */
static void ATTN_NAME(probe_rows)(int kind, const int8_t *qq, const float *qd, const float *qf,
                                  int64_t rows, int64_t hd, const void *k, const float *ks,
                                  int64_t row0, int64_t m, float scale, float *s, int64_t ld,
                                  int8_t *work)
{
    if (kind == ATTN_KV_Q8)
        attn_scores_q8(qq, qd, rows, hd, (const int8_t *)k + row0 * hd, ks + row0, m, scale, s, ld);
    else if (kind == ATTN_KV_Q4)
        attn_scores_q4(qq, qd, rows, hd, (const uint8_t *)k + row0 * hd / 2, ks + row0 * (hd / QK), m,
                       scale, s, ld, work);
    else
        attn_scores_f32(qf, rows, hd, (const float *)k + row0 * hd, m, scale, s, ld);
}

void ATTN_NAME(attention_probe)(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                                int64_t hd, const void *k, const float *ks, int64_t bs, const void *pk,
                                const float *pks, int64_t pbs, const int32_t *table, const int32_t *count,
                                int64_t nblocks, int64_t probe, float scale, float *scores, int nthreads)
{
    const int64_t nb = hd / QK;
    const int64_t rows = R * group;            /* query rows scored per kv head */
    const int64_t Hq = n_kv * group;
    const int64_t ld = ((bs > pbs ? bs : pbs) + 15) & ~(int64_t)15;
    if (probe < 1)
        probe = 1;
    int nt = kernels_threads(nthreads);
    if (nt > n_kv)
        nt = (int)n_kv;
    if (nblocks * n_kv * probe < ATTN_PARALLEL_MIN_ROWS)
        nt = 1;
    const size_t a64 = 63;
    const size_t sz_qf = ((size_t)rows * hd * sizeof(float) + a64) & ~a64;
    const size_t sz_qq = ((size_t)2 * rows * hd + a64) & ~a64;
    const size_t sz_qd = ((size_t)rows * nb * sizeof(float) + a64) & ~a64;
    const size_t sz_s = ((size_t)rows * ld * sizeof(float) + a64) & ~a64;
    const size_t scratch = sz_qf + sz_qq + sz_qd + sz_s + (size_t)ld * hd;

    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        unsigned char *base = NULL;
        if (posix_memalign((void **)&base, 64, scratch) != 0)
            base = NULL;
        float *qf = (float *)base;
        int8_t *qq = (int8_t *)(base + sz_qf);
        float *qd = (float *)(base + sz_qf + sz_qq);
        float *s = (float *)(base + sz_qf + sz_qq + sz_qd);
        int8_t *work = (int8_t *)(base + sz_qf + sz_qq + sz_qd + sz_s);

        #pragma omp for schedule(static)
        for (int64_t h = 0; h < n_kv; h++) {
            if (base == NULL) {   /* out of memory: NaN scores, not a crash */
                for (int64_t i = 0; i < nblocks; i++)
                    scores[h * nblocks + i] = NAN;
                continue;
            }
            for (int64_t r = 0; r < R; r++)
                memcpy(qf + r * group * hd, q + (r * Hq + h * group) * hd, (size_t)(group * hd) * sizeof(float));
            if (kind != ATTN_KV_F32)
                attn_quantize_q(qf, rows, hd, qq, qd);
            for (int64_t i = 0; i < nblocks; i++) {
                const int64_t n = count[i];
                const int64_t step = n / probe > 1 ? n / probe : 1;
                float best = -INFINITY;
                if ((pk != NULL && n == bs) || step == 1) {
                    /* One contiguous run: the compact copy's pbs rows, or (step 1) the slab itself. */
                    const int compact = pk != NULL && n == bs;
                    const int64_t m = (n + step - 1) / step;     /* == pbs when compact */
                    ATTN_NAME(probe_rows)(kind, qq, qd, qf, rows, hd, compact ? pk : k, compact ? pks : ks,
                                          ((int64_t)table[i] * n_kv + h) * (compact ? pbs : bs), m, scale, s,
                                          ld, work);
                    for (int64_t r = 0; r < rows; r++) {
                        const float b = attn_max(s + r * ld, m);
                        best = b > best ? b : best;
                    }
                } else {
                    const int64_t row0 = ((int64_t)table[i] * n_kv + h) * bs;
                    for (int64_t j = 0; j < n; j += step) {
                        ATTN_NAME(probe_rows)(kind, qq, qd, qf, rows, hd, k, ks, row0 + j, 1, scale, s, ld,
                                              work);
                        for (int64_t r = 0; r < rows; r++)
                            best = s[r * ld] > best ? s[r * ld] : best;
                    }
                }
                scores[h * nblocks + i] = best;
            }
        }
        free(base);
    }
}

/* ---- the bound probe: a cheap upper bound picks candidates, an exact max scores them -------
 * Semantics: kernels.h (attention_probe_bound). Per kv head: the query rows are split into
 * their positive and negative parts, q = q+ + q-, so that for a block with channel-wise key
 * maxima M and minima m, q+ . M + q- . m >= q . K[row] for every row (each channel's product
 * is largest at M where q > 0 and at m where q < 0). Both parts are scored against the block's
 * two bound rows with the q8 score primitive; the ncand best bounds, and every block that is
 * not full (no bound yet), then get the exact max over all their rows. */
void ATTN_NAME(attention_probe_bound)(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                                      int64_t hd, const void *k, const float *ks, int64_t bs,
                                      const int8_t *bk, const float *bks, const int32_t *table,
                                      const int32_t *count, int64_t nblocks, int64_t ncand, float scale,
                                      float *scores, int nthreads)
{
    const int64_t nb = hd / QK;
    const int64_t rows = R * group;            /* query rows scored per kv head */
    const int64_t Hq = n_kv * group;
    const int64_t ld = (bs + 15) & ~(int64_t)15;
    const int64_t ldb = (nblocks + 15) & ~(int64_t)15;
    int nt = kernels_threads(nthreads);
    if (nt > n_kv)
        nt = (int)n_kv;
    if (nblocks * n_kv * 2 + ncand * n_kv * bs < ATTN_PARALLEL_MIN_ROWS)
        nt = 1;
    const size_t a64 = 63;
    const size_t sz_qf = ((size_t)rows * hd * sizeof(float) + a64) & ~a64;
    const size_t sz_qq = ((size_t)2 * rows * hd + a64) & ~a64;
    const size_t sz_qd = ((size_t)rows * nb * sizeof(float) + a64) & ~a64;
    const size_t sz_s = ((size_t)rows * (ld > ldb ? ld : ldb) * sizeof(float) + a64) & ~a64;
    const size_t sz_rows = ((size_t)nblocks * hd + a64) & ~a64;
    const size_t sz_b = ((size_t)nblocks * sizeof(float) + a64) & ~a64;
    const size_t sz_idx = ((size_t)nblocks * sizeof(int64_t) + a64) & ~a64;
    const size_t sz_mark = ((size_t)nblocks + a64) & ~a64;
    /* q, q+, q- (float, then q8), two score matrices, the gathered max/min rows and their
     * scales, bounds, quickselect scratch, block indices, marks, q4 unpack space. */
    const size_t scratch = 3 * sz_qf + 3 * sz_qq + 3 * sz_qd + 2 * sz_s + 2 * sz_rows + 4 * sz_b + sz_idx +
                           sz_mark + (size_t)ld * hd;

    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        unsigned char *base = NULL;
        if (posix_memalign((void **)&base, 64, scratch) != 0)
            base = NULL;
        unsigned char *p = base;
        float *qf = (float *)p;        p += sz_qf;    /* the unit's query rows */
        float *qpf = (float *)p;       p += sz_qf;    /* their positive parts */
        float *qnf = (float *)p;       p += sz_qf;    /* their negative parts */
        int8_t *qq = (int8_t *)p;      p += sz_qq;
        int8_t *qqp = (int8_t *)p;     p += sz_qq;
        int8_t *qqn = (int8_t *)p;     p += sz_qq;
        float *qd = (float *)p;        p += sz_qd;
        float *qdp = (float *)p;       p += sz_qd;
        float *qdn = (float *)p;       p += sz_qd;
        float *s = (float *)p;         p += sz_s;
        float *s2 = (float *)p;        p += sz_s;
        int8_t *hi = (int8_t *)p;      p += sz_rows;  /* gathered max rows of the full blocks */
        int8_t *lo = (int8_t *)p;      p += sz_rows;  /* ... and min rows */
        float *his = (float *)p;       p += sz_b;
        float *los = (float *)p;       p += sz_b;
        float *bound = (float *)p;     p += sz_b;
        float *tmp = (float *)p;       p += sz_b;
        int64_t *full = (int64_t *)p;  p += sz_idx;
        uint8_t *mark = (uint8_t *)p;  p += sz_mark;
        int8_t *work = (int8_t *)p;

        #pragma omp for schedule(static)
        for (int64_t h = 0; h < n_kv; h++) {
            if (base == NULL) {   /* out of memory: NaN scores, not a crash */
                for (int64_t i = 0; i < nblocks; i++)
                    scores[h * nblocks + i] = NAN;
                continue;
            }
            for (int64_t r = 0; r < R; r++)
                memcpy(qf + r * group * hd, q + (r * Hq + h * group) * hd, (size_t)(group * hd) * sizeof(float));
            for (int64_t i = 0; i < rows * hd; i++) {
                qpf[i] = qf[i] > 0.0f ? qf[i] : 0.0f;
                qnf[i] = qf[i] < 0.0f ? qf[i] : 0.0f;
            }
            attn_quantize_q(qpf, rows, hd, qqp, qdp);
            attn_quantize_q(qnf, rows, hd, qqn, qdn);
            if (kind != ATTN_KV_F32)
                attn_quantize_q(qf, rows, hd, qq, qd);

            /* Stage 1: the full blocks' bound rows side by side, scored in one call per part (a
             * call per block cost more than the dots: 2 rows is too short a slab). */
            int64_t nfull = 0;
            for (int64_t i = 0; i < nblocks; i++) {
                mark[i] = 0;
                bound[i] = -INFINITY;
                if (count[i] != bs)
                    continue;
                const int64_t slab = ((int64_t)table[i] * n_kv + h) * 2;
                memcpy(hi + nfull * hd, bk + slab * hd, (size_t)hd);
                memcpy(lo + nfull * hd, bk + (slab + 1) * hd, (size_t)hd);
                his[nfull] = bks[slab];
                los[nfull] = bks[slab + 1];
                full[nfull++] = i;
            }
            if (nfull > 0) {
                attn_scores_q8(qqp, qdp, rows, hd, hi, his, nfull, 1.0f, s, ldb);
                attn_scores_q8(qqn, qdn, rows, hd, lo, los, nfull, 1.0f, s2, ldb);
                for (int64_t f = 0; f < nfull; f++) {
                    float best = -INFINITY;
                    for (int64_t r = 0; r < rows; r++) {
                        const float b = s[r * ldb + f] + s2[r * ldb + f];   /* q+ . max + q- . min */
                        best = b > best ? b : best;
                    }
                    bound[full[f]] = best;
                }
                mark_best(bound, NULL, nblocks, ncand < nfull ? ncand : nfull, mark, tmp);
            }

            /* Stage 2: the exact max over every row of the candidates and of blocks not yet full. */
            for (int64_t i = 0; i < nblocks; i++) {
                float best = -INFINITY;
                const int64_t n = count[i];
                if ((mark[i] || n != bs) && n > 0) {
                    ATTN_NAME(probe_rows)(kind, qq, qd, qf, rows, hd, k, ks, ((int64_t)table[i] * n_kv + h) * bs,
                                          n, scale, s, ld, work);
                    for (int64_t r = 0; r < rows; r++) {
                        const float b = attn_max(s + r * ld, n);
                        best = b > best ? b : best;
                    }
                }
                scores[h * nblocks + i] = best;
            }
        }
        free(base);
    }
}
