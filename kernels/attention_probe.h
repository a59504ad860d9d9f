/*
 * The two probes of block-sparse attention (kernels.h attention_probe, attention_probe_bound),
 * part of the attention template (attention_impl.h: the primitives they call).
 */

/* Scratch of one probe thread, for `rows` query rows: qf float[rows, hd] (the kv head's query
 * rows, gathered), qq int8[2, rows, hd] and qd float[rows, hd/QK] (their q8 form), s float[rows, ld]
 * (scores), work int8[wrows, hd] (q4 rows unpacked). The bound probe also keeps the positive and
 * negative parts of the rows, qpf/qnf float[rows, hd] with qqp/qqn and qdp/qdn as qq and qd,
 * s2 float[rows, ld], and per listed block: the gathered max and min rows hi/lo int8[nblocks, hd]
 * with their scales his/los, bounds, quickselect scratch tmp float[nblocks], the full blocks'
 * indices full int64[nblocks] and the candidate marks mark uint8[nblocks]. */
struct probe_buffers {
    float *qf, *qd, *s, *qpf, *qnf, *qdp, *qdn, *s2, *his, *los, *bound, *tmp;
    int8_t *qq, *qqp, *qqn, *hi, *lo, *work;
    int64_t *full;
    uint8_t *mark;
};

/* This thread's probe scratch, laid out in *b (see attn_scratch); returns the allocation to free. */
static unsigned char *ATTN_NAME(probe_scratch)(struct probe_buffers *b, int64_t rows, int64_t hd, int64_t ld,
                                               int64_t wrows, int64_t nblocks, int bound)
{
    const size_t q_bytes = (size_t)(rows * hd) * sizeof(float);
    const size_t qq_bytes = (size_t)(2 * rows * hd);
    const size_t qd_bytes = (size_t)(rows * (hd / QK)) * sizeof(float);
    const size_t s_bytes = (size_t)(rows * ld) * sizeof(float);
    const size_t per_block = bound ? (size_t)nblocks : 0;
    unsigned char *base = NULL;
    for (int carve = 0; carve < 2; carve++) {
        attn_scratch sc = {base, 0};
        b->qf = scratch_take(&sc, q_bytes);
        b->qpf = scratch_take(&sc, bound ? q_bytes : 0);
        b->qnf = scratch_take(&sc, bound ? q_bytes : 0);
        b->qq = scratch_take(&sc, qq_bytes);
        b->qqp = scratch_take(&sc, bound ? qq_bytes : 0);
        b->qqn = scratch_take(&sc, bound ? qq_bytes : 0);
        b->qd = scratch_take(&sc, qd_bytes);
        b->qdp = scratch_take(&sc, bound ? qd_bytes : 0);
        b->qdn = scratch_take(&sc, bound ? qd_bytes : 0);
        b->s = scratch_take(&sc, s_bytes);
        b->s2 = scratch_take(&sc, bound ? s_bytes : 0);
        b->hi = scratch_take(&sc, per_block * (size_t)hd);
        b->lo = scratch_take(&sc, per_block * (size_t)hd);
        b->his = scratch_take(&sc, per_block * sizeof(float));
        b->los = scratch_take(&sc, per_block * sizeof(float));
        b->bound = scratch_take(&sc, per_block * sizeof(float));
        b->tmp = scratch_take(&sc, per_block * sizeof(float));
        b->full = scratch_take(&sc, per_block * sizeof(int64_t));
        b->mark = scratch_take(&sc, per_block);
        b->work = scratch_take(&sc, (size_t)(wrows * hd));
        if (!carve)
            base = scratch_alloc(sc.used);
    }
    return base;
}

/* Threads of a probe, parallel over n_kv heads, that scans about `scanned` K rows in all. */
static inline int probe_threads(int nthreads, int64_t n_kv, int64_t scanned)
{
    const int nt = kernels_threads(nthreads);
    if (scanned < ATTN_PARALLEL_MIN_ROWS)
        return 1;
    return nt > n_kv ? (int)n_kv : nt;
}

/* How far ahead the bound probe asks for memory: stage 1 in blocks (their 2 bound rows), stage 2
 * in candidates (their K rows). */
#define BOUND_PREFETCH_AHEAD 8
#define PROBE_PREFETCH_AHEAD 2

/* dst = src, hd int8 (a multiple of QK): in QK-byte pieces of a constant size, which the compiler
 * turns into vector moves; a memcpy of hd bytes was a libc call per row, a quarter of stage 1's
 * time when its rows are in cache. */
static inline void copy_row_q8(int8_t *dst, const int8_t *src, int64_t hd)
{
    for (int64_t o = 0; o < hd; o += QK)
        memcpy(dst + o, src + o, QK);
}

/* Start kv head h: gather its query rows of q float[R, n_kv*group, hd] into qf float[R*group, hd].
 * Without scratch (qf NULL: out of memory) its scores are NaN instead, not a crash, and 0 says
 * to skip the head. */
static inline int probe_head(const float *q, int64_t R, int64_t n_kv, int64_t group, int64_t hd, int64_t h,
                             float *qf, float *scores, int64_t nblocks)
{
    if (qf == NULL) {
        for (int64_t i = 0; i < nblocks; i++)
            scores[h * nblocks + i] = NAN;
        return 0;
    }
    for (int64_t r = 0; r < R; r++)
        memcpy(qf + r * group * hd, q + (r * n_kv + h) * group * hd, (size_t)(group * hd) * sizeof(float));
    return 1;
}

/* ---- the strided probe ------------------------------------------------------------------
 * The scores come from this path's attn_scores_* primitive: a full block's sampled rows are one
 * contiguous run of pbs rows in the compact copy pk, scored in one call like a short slab, and so
 * is a whole slab when every row is sampled (step 1); other blocks score their sampled rows one
 * at a time. Parallel over kv heads. */
static void ATTN_NAME(probe_rows)(int kind, const int8_t *qq, const float *qd, const float *qf,
                                  int64_t rows, int64_t hd, const void *k, const float *ks,
                                  int64_t row0, int64_t m, float scale, float *s, int64_t ld,
                                  int8_t *work)
{
    if (kind == KV_Q8)
        attn_scores_q8(qq, qd, rows, hd, (const int8_t *)k + row0 * hd, ks + row0, m, scale, s, ld);
    else if (kind == KV_Q4)
        attn_scores_q4(qq, qd, rows, hd, (const uint8_t *)k + row0 * hd / 2, ks + row0 * (hd / QK), m,
                       scale, s, ld, work);
    else
        attn_scores_f32(qf, rows, hd, (const float *)k + row0 * hd, m, scale, s, ld);
}

/* A probe's job: its arguments, and each participant's scratch (made on its first head). */
struct probe_job {
    int kind;
    const float *q;
    int64_t R, n_kv, group, hd, bs, pbs, rows, ld, lds, nblocks, probe, ncand;
    const void *k, *pk;
    const float *ks, *pks, *bks;
    const int8_t *bk;
    const int32_t *table, *count;
    float scale;
    float *scores;
    int bound;
    unsigned char *base[POOL_MAX_THREADS];
    struct probe_buffers buf[POOL_MAX_THREADS];
};

/* This participant's scratch for the job (NULL members when out of memory). */
static const struct probe_buffers *ATTN_NAME(probe_buffers_of)(struct probe_job *j, int participant)
{
    if (j->base[participant] == NULL)
        j->base[participant] = ATTN_NAME(probe_scratch)(&j->buf[participant], j->rows, j->hd, j->lds, j->ld,
                                                        j->nblocks, j->bound);
    return &j->buf[participant];
}

static void ATTN_NAME(probe_free)(struct probe_job *j)
{
    for (int p = 0; p < POOL_MAX_THREADS; p++)
        free(j->base[p]);
}

static void ATTN_NAME(probe_head_strided)(void *ctx, int64_t h, int participant)
{
    struct probe_job *j = ctx;
    const struct probe_buffers *b = ATTN_NAME(probe_buffers_of)(j, participant);
    float *const qf = b->qf, *const qd = b->qd, *const s = b->s;
    int8_t *const qq = b->qq, *const work = b->work;
    const int kind = j->kind;
    const int64_t rows = j->rows, hd = j->hd, bs = j->bs, n_kv = j->n_kv, ld = j->ld, probe = j->probe;
    if (!probe_head(j->q, j->R, n_kv, j->group, hd, h, qf, j->scores, j->nblocks))
        return;
    if (kind != KV_F32)
        attn_quantize_q(qf, rows, hd, qq, qd);
    for (int64_t i = 0; i < j->nblocks; i++) {
        const int64_t n = j->count[i];
        const int64_t step = n / probe > 1 ? n / probe : 1;
        float best = -INFINITY;
        if ((j->pk != NULL && n == bs) || step == 1) {
            /* One contiguous run: the compact copy's pbs rows, or (step 1) the slab itself. */
            const int compact = j->pk != NULL && n == bs;
            const int64_t m = (n + step - 1) / step;     /* == pbs when compact */
            ATTN_NAME(probe_rows)(kind, qq, qd, qf, rows, hd, compact ? j->pk : j->k, compact ? j->pks : j->ks,
                                  ((int64_t)j->table[i] * n_kv + h) * (compact ? j->pbs : bs), m, j->scale, s,
                                  ld, work);
            for (int64_t r = 0; r < rows; r++) {
                const float v = attn_max(s + r * ld, m);
                best = v > best ? v : best;
            }
        } else {
            const int64_t row0 = ((int64_t)j->table[i] * n_kv + h) * bs;
            for (int64_t jj = 0; jj < n; jj += step) {
                ATTN_NAME(probe_rows)(kind, qq, qd, qf, rows, hd, j->k, j->ks, row0 + jj, 1, j->scale, s, ld,
                                      work);
                for (int64_t r = 0; r < rows; r++)
                    best = s[r * ld] > best ? s[r * ld] : best;
            }
        }
        j->scores[h * j->nblocks + i] = best;
    }
}

void ATTN_NAME(attention_probe)(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                                int64_t hd, const void *k, const float *ks, int64_t bs, const void *pk,
                                const float *pks, int64_t pbs, const int32_t *table, const int32_t *count,
                                int64_t nblocks, int64_t probe, float scale, float *scores, int nthreads)
{
    struct probe_job *j = calloc(1, sizeof *j);
    if (j == NULL) {
        for (int64_t i = 0; i < n_kv * nblocks; i++)
            scores[i] = NAN;
        return;
    }
    if (probe < 1)
        probe = 1;
    const int64_t ld = ((bs > pbs ? bs : pbs) + 15) & ~(int64_t)15;
    *j = (struct probe_job){.kind = kind, .q = q, .R = R, .n_kv = n_kv, .group = group, .hd = hd, .bs = bs,
                            .pbs = pbs, .rows = R * group, .ld = ld, .lds = ld, .nblocks = nblocks,
                            .probe = probe, .k = k, .pk = pk, .ks = ks, .pks = pks, .table = table,
                            .count = count, .scale = scale, .scores = scores};
    pool_run(KERNEL_PROBE, probe_threads(nthreads, n_kv, nblocks * n_kv * probe), n_kv,
             ATTN_NAME(probe_head_strided), j);
    ATTN_NAME(probe_free)(j);
    free(j);
}

/* ---- the bound probe: a cheap upper bound picks candidates, an exact max scores them -------
 * Semantics: kernels.h (attention_probe_bound). Per kv head: the query rows are split into
 * their positive and negative parts, q = q+ + q-, so that for a block with channel-wise key
 * maxima M and minima m, q+ . M + q- . m >= q . K[row] for every row (each channel's product
 * is largest at M where q > 0 and at m where q < 0). Both parts are scored against the block's
 * two bound rows with the q8 score primitive; the ncand best bounds, and every block that is
 * not full (no bound yet), then get the exact max over all their rows. */
static void ATTN_NAME(probe_head_bound)(void *ctx, int64_t h, int participant)
{
    struct probe_job *j = ctx;
    const struct probe_buffers *b = ATTN_NAME(probe_buffers_of)(j, participant);
    float *const qf = b->qf, *const qpf = b->qpf, *const qnf = b->qnf;
    int8_t *const qq = b->qq, *const qqp = b->qqp, *const qqn = b->qqn;
    float *const qd = b->qd, *const qdp = b->qdp, *const qdn = b->qdn;
    float *const s = b->s, *const s2 = b->s2;
    int8_t *const hi = b->hi, *const lo = b->lo;   /* gathered max and min rows of the full blocks */
    float *const his = b->his, *const los = b->los, *const bound = b->bound, *const tmp = b->tmp;
    int64_t *const full = b->full;
    uint8_t *const mark = b->mark;
    int8_t *const work = b->work;
    const int kind = j->kind;
    const int64_t rows = j->rows, hd = j->hd, bs = j->bs, n_kv = j->n_kv, ld = j->ld, nblocks = j->nblocks;
    const int64_t ldb = (nblocks + 15) & ~(int64_t)15, ncand = j->ncand;
    const int32_t *const table = j->table, *const count = j->count;
    if (!probe_head(j->q, j->R, n_kv, j->group, hd, h, qf, j->scores, nblocks))
        return;
    for (int64_t i = 0; i < rows * hd; i++) {
        qpf[i] = qf[i] > 0.0f ? qf[i] : 0.0f;
        qnf[i] = qf[i] < 0.0f ? qf[i] : 0.0f;
    }
    attn_quantize_q(qpf, rows, hd, qqp, qdp);
    attn_quantize_q(qnf, rows, hd, qqn, qdn);
    if (kind != KV_F32)
        attn_quantize_q(qf, rows, hd, qq, qd);

    /* Stage 1: the full blocks' bound rows side by side, scored in one call per part (a
     * call per block cost more than the dots: 2 rows is too short a slab). Gathered with the
     * rows BOUND_PREFETCH_AHEAD blocks on already asked for (28 layers cold at 8192, stage 1
     * alone: 2.67 -> 2.29 ms). */
    int64_t nfull = 0;
    for (int64_t i = 0; i < nblocks; i++) {
        if (i + BOUND_PREFETCH_AHEAD < nblocks && count[i + BOUND_PREFETCH_AHEAD] == bs)
            /* the bound rows are q8 rows with a scale each: the block's two, and their scales */
            prefetch_rows(KV_Q8, j->bk, j->bks, ((int64_t)table[i + BOUND_PREFETCH_AHEAD] * n_kv + h) * 2, 2, hd);
        mark[i] = 0;
        bound[i] = -INFINITY;
        if (count[i] != bs)
            continue;
        const int64_t slab = ((int64_t)table[i] * n_kv + h) * 2;
        copy_row_q8(hi + nfull * hd, j->bk + slab * hd, hd);
        copy_row_q8(lo + nfull * hd, j->bk + (slab + 1) * hd, hd);
        his[nfull] = j->bks[slab];
        los[nfull] = j->bks[slab + 1];
        full[nfull++] = i;
    }
    if (nfull > 0) {
        attn_scores_q8(qqp, qdp, rows, hd, hi, his, nfull, 1.0f, s, ldb);
        attn_scores_q8(qqn, qdn, rows, hd, lo, los, nfull, 1.0f, s2, ldb);
        for (int64_t f = 0; f < nfull; f++) {
            float best = -INFINITY;
            for (int64_t r = 0; r < rows; r++) {
                const float v = s[r * ldb + f] + s2[r * ldb + f];   /* q+ . max + q- . min */
                best = v > best ? v : best;
            }
            bound[full[f]] = best;
        }
        mark_best(bound, NULL, nblocks, ncand < nfull ? ncand : nfull, mark, tmp);
    }

    /* Stage 2: the exact max over every row of the candidates and of blocks not yet full. The
     * candidates lie scattered over the cache, few of them adjacent, so no hardware prefetcher
     * sees them coming: the K rows of the one after next are asked into L2 while this one is
     * scored (28 layers cold, 32 candidates: 3.07 -> 2.49 ms at 2048, 4.73 -> 4.43 at 8192;
     * one ahead into L2 measured the same, one ahead into L1 and all of them at once less). */
    int64_t nlist = 0;
    for (int64_t i = 0; i < nblocks; i++) {
        j->scores[h * nblocks + i] = -INFINITY;
        if ((mark[i] || count[i] != bs) && count[i] > 0)
            full[nlist++] = i;            /* stage 1 is done with it: now the blocks to score */
    }
    for (int64_t x = 0; x < nlist && x < PROBE_PREFETCH_AHEAD; x++)
        prefetch_rows_l2(kind, j->k, j->ks, ((int64_t)table[full[x]] * n_kv + h) * bs, count[full[x]], hd);
    for (int64_t x = 0; x < nlist; x++) {
        const int64_t i = full[x], n = count[i];
        if (x + PROBE_PREFETCH_AHEAD < nlist) {
            const int64_t ahead = full[x + PROBE_PREFETCH_AHEAD];
            prefetch_rows_l2(kind, j->k, j->ks, ((int64_t)table[ahead] * n_kv + h) * bs, count[ahead], hd);
        }
        float best = -INFINITY;
        ATTN_NAME(probe_rows)(kind, qq, qd, qf, rows, hd, j->k, j->ks, ((int64_t)table[i] * n_kv + h) * bs, n,
                              j->scale, s, ld, work);
        for (int64_t r = 0; r < rows; r++) {
            const float v = attn_max(s + r * ld, n);
            best = v > best ? v : best;
        }
        j->scores[h * nblocks + i] = best;
    }
}

void ATTN_NAME(attention_probe_bound)(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                                      int64_t hd, const void *k, const float *ks, int64_t bs,
                                      const int8_t *bk, const float *bks, const int32_t *table,
                                      const int32_t *count, int64_t nblocks, int64_t ncand, float scale,
                                      float *scores, int nthreads)
{
    struct probe_job *j = calloc(1, sizeof *j);
    if (j == NULL) {
        for (int64_t i = 0; i < n_kv * nblocks; i++)
            scores[i] = NAN;
        return;
    }
    const int64_t ld = (bs + 15) & ~(int64_t)15;
    const int64_t ldb = (nblocks + 15) & ~(int64_t)15;
    /* Stage 1 scores a row of bounds per query row, stage 2 a slab: s holds the longer. */
    *j = (struct probe_job){.kind = kind, .q = q, .R = R, .n_kv = n_kv, .group = group, .hd = hd, .bs = bs,
                            .rows = R * group, .ld = ld, .lds = ld > ldb ? ld : ldb, .nblocks = nblocks,
                            .ncand = ncand, .k = k, .ks = ks, .bk = bk, .bks = bks, .table = table,
                            .count = count, .scale = scale, .scores = scores, .bound = 1};
    pool_run(KERNEL_PROBE_BOUND, probe_threads(nthreads, n_kv, nblocks * n_kv * 2 + ncand * n_kv * bs), n_kv,
             ATTN_NAME(probe_head_bound), j);
    ATTN_NAME(probe_free)(j);
    free(j);
}
