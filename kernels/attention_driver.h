/*
 * The one-pass attention driver (kernels.h attention_*), part of the attention template
 * (attention_impl.h: the primitives it calls and how a path instantiates it).
 *
 * Blocked online softmax: per listed KV block, the scores of its visible rows are computed
 * for all query rows of the unit (up to ATTN_QTILE queries x the kv head's group), each
 * row's running max is raised once for the block (one rescale of acc and of the sum), then
 * V rows are read once and accumulated for all rows. Every K and V row is read exactly
 * once per (tile of queries, kv head): once per query head group in decode.
 *
 * Importance (block-sparse prefill, docs/engine.md): with `importance` set, the same pass also adds
 * to importance[position] the softmax weight every query head gives every listed row. Each
 * block's exp-shifted scores are kept with the running max they were shifted by, so the final
 * weight is one multiply per score, not a second scoring pass. Units write their sums to their
 * own slice and the slices are added in unit order: the result does not depend on the threads.
 */

#define ATTN_QTILE 4   /* queries per work unit */

/* Block tables are scattered over the cache, so no hardware prefetcher can guess the next
 * slab: ask for its K and V rows while the current one is computed. */
static inline void prefetch_rows(int kind, const void *kv, const float *scales, int64_t row0,
                                 int64_t bs, int64_t hd)
{
    const int64_t row_bytes = kind == KV_Q8 ? hd : kind == KV_Q4 ? hd / 2 : hd * 4;
    const char *p = (const char *)kv + row0 * row_bytes;
    for (int64_t off = 0; off < bs * row_bytes; off += 64)
        __builtin_prefetch(p + off);
    if (scales != NULL) {
        const int64_t per_row = kind == KV_Q4 ? hd / QK : 1;
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

/* Scratch of one driver thread, for units of up to R query rows: qf float[R, hd] (the unit's
 * query rows, gathered), qq int8[2, R, hd] and qd float[R, hd/QK] (their q8 form), acc float[R, hd],
 * s float[R, ld] (scores, then softmax weights), mx and sum float[R] (running max and sum),
 * work int8[bs, hd]; keeping importance also wkeep float[R, nsel*bs] (the kept weights) and
 * shift float[R, nsel] (the max each block's weights were shifted by). */
struct attn_buffers {
    float *qf, *qd, *acc, *s, *mx, *sum, *wkeep, *shift;
    int8_t *qq, *work;
};

/* This thread's driver scratch, laid out in *b (see attn_scratch); returns the allocation to free. */
static unsigned char *ATTN_NAME(attention_scratch)(struct attn_buffers *b, int64_t R, int64_t hd, int64_t ld,
                                                   int64_t bs, int64_t nsel, int keep)
{
    unsigned char *base = NULL;
    for (int carve = 0; carve < 2; carve++) {
        attn_scratch sc = {base, 0};
        b->qf = scratch_take(&sc, (size_t)(R * hd) * sizeof(float));
        b->qq = scratch_take(&sc, (size_t)(2 * R * hd));
        b->qd = scratch_take(&sc, (size_t)(R * (hd / QK)) * sizeof(float));
        b->acc = scratch_take(&sc, (size_t)(R * hd) * sizeof(float));
        b->s = scratch_take(&sc, (size_t)(R * ld) * sizeof(float));
        b->mx = scratch_take(&sc, (size_t)R * sizeof(float));
        b->sum = scratch_take(&sc, (size_t)R * sizeof(float));
        b->wkeep = scratch_take(&sc, keep ? (size_t)(R * nsel * bs) * sizeof(float) : 0);
        b->shift = scratch_take(&sc, keep ? (size_t)(R * nsel) * sizeof(float) : 0);
        b->work = scratch_take(&sc, (size_t)(bs * hd));
        if (!carve)
            base = scratch_alloc(sc.used);
    }
    return base;
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
    const int64_t scales_per_row = kind == KV_Q4 ? nb : 1;      /* q8: per row, q4: per 32-block */
    const int64_t ld = (bs + 15) & ~(int64_t)15;
    const int64_t per_unit = nsel * bs;
    const int keep = importance != NULL;   /* fixed here: importance is dropped if contrib fails */
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
        kernels_note_threads(KERNEL_ATTENTION);
        struct attn_buffers buf;
        unsigned char *base = ATTN_NAME(attention_scratch)(&buf, R, hd, ld, bs, nsel, keep);
        float *const qf = buf.qf, *const qd = buf.qd, *const acc = buf.acc, *const s = buf.s;
        float *const mx = buf.mx, *const sum = buf.sum, *const wkeep = buf.wkeep, *const shift = buf.shift;
        int8_t *const qq = buf.qq, *const work = buf.work;

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
            if (kind != KV_F32)
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

                if (kind == KV_Q8)
                    attn_scores_q8(qq, qd, rows, hd, (const int8_t *)k + row0 * row_elems,
                                   ks + row0, n, scale, s, ld);
                else if (kind == KV_Q4)
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
                if (kind == KV_Q8)
                    attn_accum_q8((const int8_t *)v + row0 * row_elems, vs + row0, n, rows, hd, s, ld, acc);
                else if (kind == KV_Q4)
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
    ATTN_NAME(attention_run)(KV_Q8, q, T, n_kv, group, hd, k, ks, v, vs, bs, table, blockpos,
                             count, nsel, table_stride, qpos, scale, out, NULL, 0, nthreads);
}

void ATTN_NAME(attention_q4)(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                             const uint8_t *k, const float *ks, const uint8_t *v, const float *vs,
                             int64_t bs, const int32_t *table, const int32_t *blockpos,
                             const int32_t *count, int64_t nsel, int64_t table_stride,
                             const int32_t *qpos, float scale, float *out, int nthreads)
{
    ATTN_NAME(attention_run)(KV_Q4, q, T, n_kv, group, hd, k, ks, v, vs, bs, table, blockpos,
                             count, nsel, table_stride, qpos, scale, out, NULL, 0, nthreads);
}

void ATTN_NAME(attention_f32)(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                              const float *k, const float *v,
                              int64_t bs, const int32_t *table, const int32_t *blockpos,
                              const int32_t *count, int64_t nsel, int64_t table_stride,
                              const int32_t *qpos, float scale, float *out, int nthreads)
{
    ATTN_NAME(attention_run)(KV_F32, q, T, n_kv, group, hd, k, NULL, v, NULL, bs, table,
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

