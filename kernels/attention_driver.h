/*
 * The one-pass attention driver (kernels.h attention_*), part of the attention template
 * (attention_impl.h: the primitives it calls and how a path instantiates it).
 *
 * Blocked online softmax: per listed KV block, the scores of its visible rows are computed
 * for all query rows of the unit (up to ATTN_QTILE queries x the kv head's group), each
 * row's running max is raised once for the block (one rescale of acc and of the sum), then
 * V rows are read once and accumulated for all rows. Every K and V row is read exactly
 * once per (tile of queries, kv head): once per query head group in decode. A unit walks its
 * kv heads block by block, so that with the list shared by the heads (exact attention) the
 * slabs it reads lie side by side and K and V stream in memory order.
 *
 * Importance (block-sparse prefill, docs/engine.md): with `importance` set, the same pass also adds
 * to importance[position] the softmax weight every query head gives every listed row. Each
 * block's exp-shifted scores are kept with the running max they were shifted by, so the final
 * weight is one multiply per score, not a second scoring pass. Units write their sums to their
 * own slice and the slices are added in unit order: the result does not depend on the threads.
 */

#define ATTN_QTILE 4   /* queries per work unit */
#define ATTN_MAX_GROUP 64   /* query heads per kv head (Qwen3: 2 to 8) */
/* A list of listed blocks is cut into parts that threads scan side by side, merged in part order:
 * ATTN_SPLIT_PARTS parts of at least ATTN_SPLIT_MIN and at most ATTN_SPLIT_MAX blocks (attn_split).
 * The cut depends on the list's length alone, never on the threads or the other queries, so decode
 * and prefill agree bit for bit. Parts, not head ranges, give a decode step its parallelism: a unit
 * then walks every kv head of its blocks, whose slabs lie side by side, so K and V stream in memory
 * order (attn_locate). */
#define ATTN_SPLIT_PARTS 4
#define ATTN_SPLIT_MIN 8
#define ATTN_SPLIT_MAX 32
/* K and V a unit of a many-query call may read, about half a core's L2 (A76: 512 KB). */
#define ATTN_UNIT_CACHE_BYTES (256 * 1024)

/* Bytes of one cached K or V row of `kind`, and its scales (floats; none for f32). */
static inline int64_t kv_row_bytes(int kind, int64_t hd)
{
    return kind == KV_Q8 ? hd : kind == KV_Q4 ? hd / 2 : hd * 4;
}

static inline int64_t kv_row_scales(int kind, int64_t hd)
{
    return kind == KV_Q4 ? hd / QK : kind == KV_Q8 ? 1 : 0;
}

/* Listed blocks a part of a list of nsel blocks scans (attn_seq.split). */
static inline int64_t attn_split(int64_t nsel)
{
    const int64_t per = (nsel + ATTN_SPLIT_PARTS - 1) / ATTN_SPLIT_PARTS;
    return per < ATTN_SPLIT_MIN ? ATTN_SPLIT_MIN : per > ATTN_SPLIT_MAX ? ATTN_SPLIT_MAX : per;
}

/* Ask for rows row0 .. row0+n-1 of a cache array and their scales, into L1 (to_l2 0) or L2 (1).
 * __builtin_prefetch wants its locality as a constant: callers pass a literal, and inlining
 * keeps one branch. */
static inline __attribute__((always_inline)) void prefetch_kv_rows(int kind, const void *kv, const float *scales,
                                                                   int64_t row0, int64_t n, int64_t hd, int to_l2)
{
    const int64_t row_bytes = kv_row_bytes(kind, hd);
    const char *p = (const char *)kv + row0 * row_bytes;
    const char *sp = scales != NULL ? (const char *)(scales + row0 * kv_row_scales(kind, hd)) : NULL;
    const int64_t scale_bytes = sp != NULL ? n * kv_row_scales(kind, hd) * (int64_t)sizeof(float) : 0;
    for (int64_t off = 0; off < n * row_bytes; off += 64) {
        if (to_l2)
            __builtin_prefetch(p + off, 0, 2);
        else
            __builtin_prefetch(p + off);
    }
    for (int64_t off = 0; off < scale_bytes; off += 64) {
        if (to_l2)
            __builtin_prefetch(sp + off, 0, 2);
        else
            __builtin_prefetch(sp + off);
    }
}

/* Block tables are scattered over the cache, so no hardware prefetcher can guess the next
 * slab: ask for its K and V rows while the current one is computed. */
static inline void prefetch_rows(int kind, const void *kv, const float *scales, int64_t row0,
                                 int64_t bs, int64_t hd)
{
    prefetch_kv_rows(kind, kv, scales, row0, bs, hd, 0);
}

/* The same into L2, for a slab needed a while later. */
static inline void prefetch_rows_l2(int kind, const void *kv, const float *scales, int64_t row0,
                                    int64_t n, int64_t hd)
{
    prefetch_kv_rows(kind, kv, scales, row0, n, hd, 1);
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

/* Scratch of one driver thread, for units of up to R query rows in each of up to H kv heads: per
 * head qf float[R, hd] (the unit's query rows, gathered), qq int8[2, R, hd] and qd float[R, hd/QK]
 * (their q8 form), acc float[R, hd], mx and sum float[R] (running max and sum); shared by the heads
 * s float[R, ld] (scores, then softmax weights) and work int8[bs, hd]; keeping importance (one
 * head a unit) also wkeep float[R, nsel*bs] (the kept weights) and shift float[R, nsel] (the max
 * each block's weights were shifted by). Head hh's rows start at hh * R (hh * R * hd, ...). */
struct attn_buffers {
    float *qf, *qd, *acc, *s, *mx, *sum, *wkeep, *shift;
    int8_t *qq, *work;
};

/* This thread's driver scratch, laid out in *b (see attn_scratch); returns the allocation to free. */
static unsigned char *ATTN_NAME(attention_scratch)(struct attn_buffers *b, int64_t R, int64_t H, int64_t hd,
                                                   int64_t ld, int64_t bs, int64_t nsel, int keep)
{
    unsigned char *base = NULL;
    for (int carve = 0; carve < 2; carve++) {
        attn_scratch sc = {base, 0};
        b->qf = scratch_take(&sc, (size_t)(H * R * hd) * sizeof(float));
        b->qq = scratch_take(&sc, (size_t)(H * 2 * R * hd));
        b->qd = scratch_take(&sc, (size_t)(H * R * (hd / QK)) * sizeof(float));
        b->acc = scratch_take(&sc, (size_t)(H * R * hd) * sizeof(float));
        b->s = scratch_take(&sc, (size_t)(R * ld) * sizeof(float));
        b->mx = scratch_take(&sc, (size_t)(H * R) * sizeof(float));
        b->sum = scratch_take(&sc, (size_t)(H * R) * sizeof(float));
        b->wkeep = scratch_take(&sc, keep ? (size_t)(R * nsel * bs) * sizeof(float) : 0);
        b->shift = scratch_take(&sc, keep ? (size_t)(R * nsel) * sizeof(float) : 0);
        b->work = scratch_take(&sc, (size_t)(bs * hd));
        if (!carve)
            base = scratch_alloc(sc.used);
    }
    return base;
}

/* One sequence of a call, as the driver cuts it into units: a unit is a tile of up to ATTN_QTILE
 * of its queries x a range of kv heads x one part of their block lists (attn_split listed blocks;
 * long lists are scanned in parts by several threads and the parts merged). */
struct attn_seq {
    int64_t row0, T;              /* its queries: rows row0 .. row0+T-1 of q, out and qpos */
    int64_t list0, nsel, stride;  /* kv head h lists entries list0 + h*stride + 0 .. nsel-1 */
    int64_t qtile, ntiles, nsplits;
    int64_t split;                /* listed blocks a part (the last part: what is left) */
    int64_t unit0, group0;        /* its first unit; its first (tile, head) pair */
    int64_t part0;                /* its first float of the parts buffer */
};

struct attn_job {
    int kind;
    const float *q;
    int64_t n_kv, group, hd, bs, ld, R, nsel_max;
    int64_t hper;                 /* kv heads per unit (a range of them) */
    int64_t unit_floats;          /* decode route: floats of a unit's slice of the parts buffer */
    const void *k, *v;
    const float *ks, *vs;
    const int32_t *table, *blockpos, *count, *qpos;
    float scale;
    float *out;
    const struct attn_seq *seqs;
    int64_t nseq;
    float *parts;                 /* per (tile, head) pair with parts: nsplits x R x (hd + 2) floats */
    uint32_t *parts_left;         /* per (tile, head) pair: parts not yet scanned */
    float *importance, *contrib;  /* importance: one sequence, one part; contrib per unit of the wave */
    int64_t wave0;
    int keep;
    unsigned char *base[POOL_MAX_THREADS];
    struct attn_buffers buf[POOL_MAX_THREADS];
};

/* Merge the parts of one (tile, head) pair into its output rows, in part order (the same on
 * every run): running max, rescaled sums and accumulators, as one scan would have combined them.
 * Part p starts at parts + p * part_stride: acc float[R, hd], then mx float[R], then sum float[R]. */
static void ATTN_NAME(merge_parts)(const float *parts, int64_t part_stride, int64_t nsplits, int64_t rows,
                                   int64_t R, int64_t hd, float *const orow[])
{
    for (int64_t r = 0; r < rows; r++) {
        float m = -INFINITY;
        for (int64_t p = 0; p < nsplits; p++) {
            const float pm = parts[p * part_stride + R * hd + r];
            m = pm > m ? pm : m;
        }
        float *o = orow[r];
        memset(o, 0, (size_t)hd * sizeof(float));
        if (m == -INFINITY)
            continue;                 /* saw no row: zeros */
        float l = 0.0f;
        for (int64_t p = 0; p < nsplits; p++) {
            const float *part = parts + p * part_stride;
            const float pm = part[R * hd + r];
            if (pm == -INFINITY)
                continue;
            const float f = expf(pm - m);
            l += part[R * hd + R + r] * f;
            const float *a = part + r * hd;
            for (int64_t d = 0; d < hd; d++)
                o[d] += a[d] * f;
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int64_t d = 0; d < hd; d++)
            o[d] *= inv;
    }
}

/* The first row of the slab of listed entry i of kv head h (its list: list0 + h * stride). */
static inline int64_t slab_row0(const struct attn_job *j, const struct attn_seq *sq, int64_t h, int64_t i)
{
    return ((int64_t)j->table[sq->list0 + h * sq->stride + i] * j->n_kv + h) * j->bs;
}

/* Head hh's running sums from b (rows hh * R ...) into a part, merge_parts' layout. */
static inline void attn_store_part(float *part, const struct attn_buffers *b, int64_t hh, int64_t R, int64_t hd,
                                   int64_t rows)
{
    memcpy(part, b->acc + hh * R * hd, (size_t)(rows * hd) * sizeof(float));
    memcpy(part + R * hd, b->mx + hh * R, (size_t)rows * sizeof(float));
    memcpy(part + R * hd + R, b->sum + hh * R, (size_t)rows * sizeof(float));
}

/* Where a unit lies: its sequence, kv heads h0 .. h0+nh-1, query tile (queries t0 .. t0+qt-1, rows
 * r: query t0 + r / group, head h*group + r % group) and part (listed blocks i0 .. i1-1). */
struct attn_unit_at {
    const struct attn_seq *sq;
    int64_t h0, nh, tile, part, t0, qt, rows, i0, i1;
};

static inline void attn_locate(const struct attn_job *j, int64_t unit, struct attn_unit_at *u)
{
    int64_t lo = 0, hi = j->nseq - 1;   /* the sequence holding the unit */
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (j->seqs[mid].unit0 <= unit)
            lo = mid;
        else
            hi = mid - 1;
    }
    const struct attn_seq *sq = u->sq = &j->seqs[lo];
    const int64_t local = unit - sq->unit0;
    const int64_t hg = local / (sq->ntiles * sq->nsplits);
    u->tile = local / sq->nsplits % sq->ntiles;
    u->part = local % sq->nsplits;
    /* kv heads h0 .. h1-1, walked block by block: the slabs of one listed block lie side by side
     * (head-major inside a block), so with a shared list K and V are read in memory order. */
    u->h0 = hg * j->hper;
    u->nh = (u->h0 + j->hper < j->n_kv ? u->h0 + j->hper : j->n_kv) - u->h0;
    /* Latest queries, which see the most rows, first: the pool's counter then ends on short units. */
    const int64_t t1 = sq->T - u->tile * sq->qtile;
    u->t0 = t1 - sq->qtile > 0 ? t1 - sq->qtile : 0;
    u->qt = t1 - u->t0;
    u->rows = u->qt * j->group;
    u->i0 = u->part * sq->split;
    u->i1 = u->i0 + sq->split < sq->nsel ? u->i0 + sq->split : sq->nsel;
}

/* Output row r of kv head h for a unit at query t0. */
static inline float *attn_out_row(const struct attn_job *j, const struct attn_seq *sq, int64_t t0, int64_t h,
                                  int64_t r)
{
    return j->out + ((sq->row0 + t0 + r / j->group) * j->n_kv * j->group + h * j->group + r % j->group) * j->hd;
}

/* Scan a unit's part of the list for its heads and query rows: per head hh, b's acc, mx and sum
 * (rows hh * R ...) end as the online softmax left them; keeping importance (j->contrib), also
 * wkeep and shift. Beats the pool once a listed block (pool_beat): a unit runs for milliseconds. */
static void ATTN_NAME(unit_scan)(const struct attn_job *j, const struct attn_unit_at *u,
                                 const struct attn_buffers *b)
{
    const struct attn_seq *sq = u->sq;
    const int64_t kind = j->kind, n_kv = j->n_kv, group = j->group, hd = j->hd, bs = j->bs, ld = j->ld;
    const int64_t Hq = n_kv * group, nb = hd / QK, R = j->R;
    const int64_t h0 = u->h0, nh = u->nh, t0 = u->t0, qt = u->qt, rows = u->rows;
    const int32_t *qpos = j->qpos + sq->row0;
    float *const s = b->s, *const wkeep = b->wkeep, *const shift = b->shift;
    int8_t *const work = b->work;
    const int64_t per_unit = sq->nsel * bs;

    for (int64_t hh = 0; hh < nh; hh++) {
        const int64_t h = h0 + hh;
        float *const qf = b->qf + hh * R * hd;
        for (int64_t tt = 0; tt < qt; tt++)
            memcpy(qf + tt * group * hd, j->q + ((sq->row0 + t0 + tt) * Hq + h * group) * hd,
                   (size_t)(group * hd) * sizeof(float));
        if (kind != KV_F32)
            attn_quantize_q(qf, rows, hd, b->qq + hh * 2 * R * hd, b->qd + hh * R * nb);
        for (int64_t r = 0; r < rows; r++) {
            b->mx[hh * R + r] = -INFINITY;
            b->sum[hh * R + r] = 0.0f;
        }
        memset(b->acc + hh * R * hd, 0, (size_t)(rows * hd) * sizeof(float));
    }
    if (j->contrib != NULL)
        for (int64_t r = 0; r < rows * sq->nsel; r++)
            shift[r] = -INFINITY;   /* block never scored for this row: weight 0 */

    for (int64_t i = u->i0; i < u->i1; i++) {
        pool_beat();
        for (int64_t hh = 0; hh < nh; hh++) {
            const int64_t h = h0 + hh;
            const int64_t idx = sq->list0 + h * sq->stride + i;
            const float *const qf = b->qf + hh * R * hd, *const qd = b->qd + hh * R * nb;
            const int8_t *const qq = b->qq + hh * 2 * R * hd;
            float *const acc = b->acc + hh * R * hd, *const mx = b->mx + hh * R, *const sum = b->sum + hh * R;
            const int64_t p0 = (int64_t)j->blockpos[idx] * bs;
            int64_t vis[ATTN_QTILE];   /* rows of this block visible to each query */
            int64_t n = 0;             /* ... to any of them */
            for (int64_t tt = 0; tt < qt; tt++) {
                int64_t c = j->count[idx];
                const int64_t upto = (int64_t)qpos[t0 + tt] - p0 + 1;
                if (upto < c)
                    c = upto;
                vis[tt] = c > 0 ? c : 0;
                n = vis[tt] > n ? vis[tt] : n;
            }
            if (n <= 0)
                continue;
            const int64_t row0 = slab_row0(j, sq, h, i);   /* first row of the slab */
            /* K of the next slab in this unit's order (the next head's, or the first head's of
             * the next block) now, its V after this slab's scores. (Prefetching 2, 4 or 8 blocks
             * ahead, or into L2 only, measured the same at 4K context, cold.) */
            const int64_t next0 = hh + 1 < nh ? slab_row0(j, sq, h + 1, i) : i + 1 < u->i1 ? slab_row0(j, sq, h0, i + 1) : -1;
            if (next0 >= 0)
                prefetch_rows(kind, j->k, j->ks, next0, bs, hd);

            if (kind == KV_Q8)
                attn_scores_q8(qq, qd, rows, hd, (const int8_t *)j->k + row0 * hd, j->ks + row0, n, j->scale, s, ld);
            else if (kind == KV_Q4)
                attn_scores_q4(qq, qd, rows, hd, (const uint8_t *)j->k + row0 * hd / 2, j->ks + row0 * nb, n,
                               j->scale, s, ld, work);
            else
                attn_scores_f32(qf, rows, hd, (const float *)j->k + row0 * hd, n, j->scale, s, ld);

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
                for (int64_t jj = nr; jj < n; jj++)   /* causally hidden from this query */
                    sr[jj] = 0.0f;
                if (j->contrib != NULL && nr > 0) {
                    memcpy(wkeep + r * per_unit + i * bs, sr, (size_t)n * sizeof(float));
                    shift[r * sq->nsel + i] = mx[r];
                }
            }

            if (next0 >= 0)
                prefetch_rows(kind, j->v, j->vs, next0, bs, hd);
            if (kind == KV_Q8)
                attn_accum_q8((const int8_t *)j->v + row0 * hd, j->vs + row0, n, rows, hd, s, ld, acc);
            else if (kind == KV_Q4)
                attn_accum_q4((const uint8_t *)j->v + row0 * hd / 2, j->vs + row0 * nb, n, rows, hd, s, ld, acc);
            else
                attn_accum_f32((const float *)j->v + row0 * hd, n, rows, hd, s, ld, acc);
        }
    }
}

/* A unit of a call that waits for every unit (pool_run): prefill, and keeping importance. */
static void ATTN_NAME(attention_unit)(void *ctx, int64_t chunk, int participant)
{
    struct attn_job *j = ctx;
    struct attn_unit_at u;
    attn_locate(j, j->wave0 + chunk, &u);
    const struct attn_seq *sq = u.sq;
    const int64_t hd = j->hd, bs = j->bs, R = j->R, rows = u.rows;

    if (j->base[participant] == NULL)
        j->base[participant] = ATTN_NAME(attention_scratch)(&j->buf[participant], R, j->hper, hd, j->ld, bs,
                                                            j->nsel_max, j->keep);
    const struct attn_buffers *b = &j->buf[participant];
    if (j->base[participant] == NULL) {   /* out of memory: fail loudly in the numbers, not in a crash */
        for (int64_t h = u.h0; h < u.h0 + u.nh; h++)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t d = 0; d < hd; d++)
                    attn_out_row(j, sq, u.t0, h, r)[d] = NAN;
        if (j->contrib != NULL)
            for (int64_t i = 0; i < sq->nsel * bs; i++)
                j->contrib[chunk * sq->nsel * bs + i] = NAN;
        return;
    }
    ATTN_NAME(unit_scan)(j, &u, b);

    const int64_t per_unit = sq->nsel * bs;
    for (int64_t hh = 0; hh < u.nh; hh++) {
        const int64_t h = u.h0 + hh;
        const float *const acc = b->acc + hh * R * hd, *const mx = b->mx + hh * R, *const sum = b->sum + hh * R;
        float *orow[ATTN_QTILE * ATTN_MAX_GROUP];
        for (int64_t r = 0; r < rows; r++)
            orow[r] = attn_out_row(j, sq, u.t0, h, r);
        if (sq->nsplits == 1) {
            /* A query that sees no row gets zeros, not 0/0. */
            for (int64_t r = 0; r < rows; r++) {
                const float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f;
                for (int64_t d = 0; d < hd; d++)
                    orow[r][d] = acc[r * hd + d] * inv;
            }
            if (j->contrib != NULL)   /* keeping importance: one head a unit */
                ATTN_NAME(importance_unit)(b->wkeep, b->shift, mx, sum, rows, sq->nsel, bs, sq->list0 + h * sq->stride,
                                           j->blockpos, j->count, j->qpos + sq->row0 + u.t0, j->group, per_unit,
                                           j->contrib + chunk * per_unit);
            continue;
        }
        /* One part of several: keep it; the thread that scans the pair's last part merges them all. */
        const int64_t pair = sq->group0 + h * sq->ntiles + u.tile;
        const int64_t part_floats = R * (hd + 2);
        float *mine = j->parts + sq->part0 + ((h * sq->ntiles + u.tile) * sq->nsplits + u.part) * part_floats;
        attn_store_part(mine, b, hh, R, hd, rows);
        if (__atomic_sub_fetch(&j->parts_left[pair], 1, __ATOMIC_ACQ_REL) == 0)
            ATTN_NAME(merge_parts)(mine - u.part * part_floats, part_floats, sq->nsplits, rows, R, hd, orow);
    }
}

#include "attention_decode.h"

/* The driver for several sequences at once (attention_batch) and for one (the others). */
static void ATTN_NAME(attention_run)(int kind, const float *q, int64_t nseq, const int64_t *seq_rows,
                                     const int64_t *seq_lists, int64_t n_kv, int64_t group, int64_t hd,
                                     const void *k, const float *ks, const void *v, const float *vs,
                                     int64_t bs, const int32_t *table, const int32_t *blockpos,
                                     const int32_t *count, const int32_t *qpos, float scale, float *out,
                                     float *importance, int64_t n_positions, int nthreads)
{
    if (nseq <= 0 || group > ATTN_MAX_GROUP)
        return;
    struct attn_seq one;
    struct attn_seq *seqs = nseq == 1 ? &one : malloc((size_t)nseq * sizeof *seqs);
    if (seqs == NULL) {   /* out of memory: NaN where the results go */
        for (int64_t i = 0; i < seq_rows[nseq] * n_kv * group * hd; i++)
            out[i] = NAN;
        return;
    }
    const int keep = importance != NULL && nseq == 1;
    int64_t nunits = 0, tile_parts = 0, npairs = 0, nparts_floats = 0, scanned = 0, Tmax = 0, nsel_max = 0;
    for (int64_t si = 0; si < nseq; si++) {
        struct attn_seq *sq = &seqs[si];
        sq->row0 = seq_rows[si];
        sq->T = seq_rows[si + 1] - seq_rows[si];
        sq->list0 = seq_lists[3 * si];
        sq->nsel = seq_lists[3 * si + 1];
        sq->stride = seq_lists[3 * si + 2];
        sq->qtile = sq->T < ATTN_QTILE ? sq->T : ATTN_QTILE;
        sq->ntiles = sq->T > 0 ? (sq->T + sq->qtile - 1) / sq->qtile : 0;
        sq->split = keep ? (sq->nsel > 0 ? sq->nsel : 1) : attn_split(sq->nsel);
        sq->nsplits = sq->nsel <= sq->split ? 1 : (sq->nsel + sq->split - 1) / sq->split;
        if (sq->nsel <= 0)
            sq->ntiles = 0;   /* nothing listed: zeros (below), no units */
        sq->group0 = npairs;
        npairs += sq->ntiles * n_kv;
        tile_parts += sq->ntiles * sq->nsplits;
        Tmax = sq->T > Tmax ? sq->T : Tmax;
        nsel_max = sq->nsel > nsel_max ? sq->nsel : nsel_max;
        scanned += sq->T * n_kv * sq->nsel * bs;
    }
    int nt = kernels_threads(nthreads);
    /* Only the shortest scans stay on the calling thread. Between a layer's GEMMs and its attention
     * the workers are still spinning (the pool spins 200 us before it sleeps), so a decode step's
     * attention at context 32-128 (256-1024 rows) is faster on two threads: 0.54 against 0.67 ms a
     * step at 32, 0.94-1.12 against 1.39-1.47 at 128 (Zen 4; the limit was 2048 rows). */
    if (scanned < ATTN_PARALLEL_MIN_ROWS)
        nt = 1;
    /* kv heads per unit: as many as still leave a unit a thread (every head once the list has a
     * part a thread: from 8 listed blocks a thread on, attn_split), one when keeping importance. A
     * unit walking every head streams K and V in memory order, which beats finer balance: cold, 28
     * layers, Zen 4, 2 threads, one decode query, two units a thread of 4 heads against a unit a
     * thread of 8 heads over 4 parts took 3.71 -> 2.52 ms at 1024 positions, 6.13 -> 4.70 at 2048,
     * 9.07 -> 6.87 at 3072 (docs/performance.md). A head's arithmetic is the same in any unit, so
     * the results do not depend on this choice (nor on the threads). */
    const int64_t want = (int64_t)nt;   /* tile_parts: units of one head range */
    int64_t ranges = keep ? n_kv : tile_parts >= want ? 1 : (want + tile_parts - 1) / (tile_parts > 0 ? tile_parts : 1);
    if (!keep && Tmax > ATTN_QTILE) {
        /* Several query tiles read the same slabs (prefill, an image's patches): a unit's heads
         * then keep their K and V within ATTN_UNIT_CACHE_BYTES, so that the next tile of the same
         * heads, taken next from the pool's counter, finds them in this core's cache. All heads a
         * unit read 6.4 MB a tile for a 784-patch image, streamed again by each of its 196 tiles. */
        const int64_t kv_row = kv_row_bytes(kind, hd) + kv_row_scales(kind, hd) * (int64_t)sizeof(float);
        const int64_t split = attn_split(nsel_max), blocks = nsel_max < split ? nsel_max : split;
        const int64_t per_head = 2 * blocks * bs * kv_row;
        const int64_t fit = per_head > 0 && ATTN_UNIT_CACHE_BYTES / per_head > 1 ? ATTN_UNIT_CACHE_BYTES / per_head : 1;
        const int64_t need = (n_kv + fit - 1) / fit;
        ranges = ranges > need ? ranges : need;
    }
    ranges = ranges < n_kv ? ranges : n_kv;
    const int64_t hper = (n_kv + ranges - 1) / ranges;
    const int64_t ngroups = (n_kv + hper - 1) / hper;
    for (int64_t si = 0; si < nseq; si++) {
        seqs[si].unit0 = nunits;
        nunits += seqs[si].ntiles * ngroups * seqs[si].nsplits;
    }
    const int64_t R = (Tmax < ATTN_QTILE ? Tmax : ATTN_QTILE) * group;
    for (int64_t si = 0; si < nseq; si++) {
        seqs[si].part0 = nparts_floats;
        if (seqs[si].nsplits > 1)
            nparts_floats += seqs[si].ntiles * n_kv * seqs[si].nsplits * R * (hd + 2);
        if (seqs[si].ntiles == 0)
            memset(out + seqs[si].row0 * n_kv * group * hd, 0, (size_t)(seqs[si].T * n_kv * group * hd) * sizeof(float));
    }

    /* The call as cut into units, for either route. */
    const struct attn_job cut = {.kind = kind, .q = q, .n_kv = n_kv, .group = group, .hd = hd, .bs = bs,
                                 .ld = (bs + 15) & ~(int64_t)15, .R = R, .nsel_max = nsel_max, .k = k, .v = v,
                                 .ks = ks, .vs = vs, .table = table, .blockpos = blockpos, .count = count,
                                 .qpos = qpos, .scale = scale, .out = out, .seqs = seqs, .nseq = nseq,
                                 .keep = keep, .hper = hper};
    if (!keep && Tmax <= ATTN_QTILE) {   /* every sequence in one tile: a decode step */
        ATTN_NAME(attention_decode)(&cut, nunits, nt, seq_rows[nseq]);
        if (seqs != &one)
            free(seqs);
        return;
    }
    struct attn_job *j = calloc(1, sizeof *j);
    float *parts = nparts_floats ? malloc((size_t)nparts_floats * sizeof(float)) : NULL;
    uint32_t *parts_left = nparts_floats ? malloc((size_t)npairs * sizeof(uint32_t)) : NULL;
    if (j == NULL || (nparts_floats && (parts == NULL || parts_left == NULL))) {
        for (int64_t i = 0; i < seq_rows[nseq] * n_kv * group * hd; i++)
            out[i] = NAN;
        if (importance != NULL)
            for (int64_t i = 0; i < n_positions; i++)
                importance[i] = NAN;
        goto done;
    }
    for (int64_t si = 0; si < nseq && parts_left != NULL; si++)
        for (int64_t p = 0; p < seqs[si].ntiles * n_kv; p++)
            parts_left[seqs[si].group0 + p] = (uint32_t)seqs[si].nsplits;
    *j = cut;
    j->parts = parts;
    j->parts_left = parts_left;
    if (!keep) {
        pool_run(KERNEL_ATTENTION, nt, nunits, ATTN_NAME(attention_unit), j);
    } else {
        /* Units per wave: their contrib slices take at most 8 MB, whatever the thread count. */
        const int64_t per_unit = seqs[0].nsel * bs;
        const int64_t cap = ((int64_t)1 << 21) / (per_unit > 0 ? per_unit : 1);
        const int64_t wave = cap < 1 ? 1 : cap < nunits ? cap : nunits;
        j->contrib = malloc((size_t)(wave * per_unit) * sizeof(float));
        if (j->contrib == NULL) {   /* out of memory: NaN importance, still the right output */
            for (int64_t i = 0; i < n_positions; i++)
                importance[i] = NAN;
            j->keep = 0;
            pool_run(KERNEL_ATTENTION, nt, nunits, ATTN_NAME(attention_unit), j);
        }
        for (int64_t w0 = 0; j->contrib != NULL && w0 < nunits; w0 += wave) {
            const int64_t w1 = w0 + wave < nunits ? w0 + wave : nunits;
            j->wave0 = w0;
            pool_run(KERNEL_ATTENTION, nt, w1 - w0, ATTN_NAME(attention_unit), j);
            /* The wave's slices, added in unit order: the sums do not depend on the threads. */
            const struct attn_seq *sq = &seqs[0];
            for (int64_t unit = w0; unit < w1; unit++) {
                const float *c = j->contrib + (unit - w0) * per_unit;
                const int64_t h = unit / sq->ntiles;
                for (int64_t i = 0; i < sq->nsel; i++) {
                    const int64_t idx = sq->list0 + h * sq->stride + i;
                    const int64_t p0 = (int64_t)blockpos[idx] * bs;
                    for (int64_t jj = 0; jj < count[idx] && p0 + jj < n_positions; jj++)
                        importance[p0 + jj] += c[i * bs + jj];
                }
            }
        }
        free(j->contrib);
    }
    for (int p = 0; p < POOL_MAX_THREADS; p++)
        free(j->base[p]);
done:
    free(j);
    free(parts);
    free(parts_left);
    if (seqs != &one)
        free(seqs);
}

/* The entry points of one sequence: seq_rows {0, T}, its list (shared, or per kv head). */
#define ATTN_ONE(T, nsel, table_stride) \
    const int64_t seq_rows[2] = {0, T}, seq_lists[3] = {0, nsel, table_stride}

void ATTN_NAME(attention_q8)(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                             const int8_t *k, const float *ks, const int8_t *v, const float *vs,
                             int64_t bs, const int32_t *table, const int32_t *blockpos,
                             const int32_t *count, int64_t nsel, int64_t table_stride,
                             const int32_t *qpos, float scale, float *out, int nthreads)
{
    ATTN_ONE(T, nsel, table_stride);
    ATTN_NAME(attention_run)(KV_Q8, q, 1, seq_rows, seq_lists, n_kv, group, hd, k, ks, v, vs, bs, table,
                             blockpos, count, qpos, scale, out, NULL, 0, nthreads);
}

void ATTN_NAME(attention_q4)(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                             const uint8_t *k, const float *ks, const uint8_t *v, const float *vs,
                             int64_t bs, const int32_t *table, const int32_t *blockpos,
                             const int32_t *count, int64_t nsel, int64_t table_stride,
                             const int32_t *qpos, float scale, float *out, int nthreads)
{
    ATTN_ONE(T, nsel, table_stride);
    ATTN_NAME(attention_run)(KV_Q4, q, 1, seq_rows, seq_lists, n_kv, group, hd, k, ks, v, vs, bs, table,
                             blockpos, count, qpos, scale, out, NULL, 0, nthreads);
}

void ATTN_NAME(attention_f32)(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                              const float *k, const float *v,
                              int64_t bs, const int32_t *table, const int32_t *blockpos,
                              const int32_t *count, int64_t nsel, int64_t table_stride,
                              const int32_t *qpos, float scale, float *out, int nthreads)
{
    ATTN_ONE(T, nsel, table_stride);
    ATTN_NAME(attention_run)(KV_F32, q, 1, seq_rows, seq_lists, n_kv, group, hd, k, NULL, v, NULL, bs,
                             table, blockpos, count, qpos, scale, out, NULL, 0, nthreads);
}

void ATTN_NAME(attention_importance)(int kind, const float *q, int64_t T, int64_t n_kv, int64_t group,
                                     int64_t hd, const void *k, const float *ks, const void *v,
                                     const float *vs, int64_t bs, const int32_t *table,
                                     const int32_t *blockpos, const int32_t *count, int64_t nsel,
                                     int64_t table_stride, const int32_t *qpos, float scale,
                                     float *out, float *importance, int64_t n_positions, int nthreads)
{
    ATTN_ONE(T, nsel, table_stride);
    ATTN_NAME(attention_run)(kind, q, 1, seq_rows, seq_lists, n_kv, group, hd, k, ks, v, vs, bs, table,
                             blockpos, count, qpos, scale, out, importance, n_positions, nthreads);
}

void ATTN_NAME(attention_batch)(int kind, const float *q, int64_t nseq, const int64_t *seq_rows,
                                const int64_t *seq_lists, int64_t n_kv, int64_t group, int64_t hd,
                                const void *k, const float *ks, const void *v, const float *vs, int64_t bs,
                                const int32_t *table, const int32_t *blockpos, const int32_t *count,
                                const int32_t *qpos, float scale, float *out, int nthreads)
{
    ATTN_NAME(attention_run)(kind, q, nseq, seq_rows, seq_lists, n_kv, group, hd, k, ks, v, vs, bs, table,
                             blockpos, count, qpos, scale, out, NULL, 0, nthreads);
}
