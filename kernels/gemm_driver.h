/*
 * The GEMM/GEMV driver of the SIMD paths (kernels.h gemm_{q8,q4}_simd), a C "template".
 *
 * The including path file defines NR (weight rows per tile), MR (activation rows per tile),
 * GEMM_PANEL_BYTES, GEMM_Q4_XSUM8 (1 when its Q4 tile takes xsum8[m, b] = 8 * the sum of
 * activation block b of row m, 0 when it has no use for it) and the micro-kernel
 *   gemm_tile(is_q4, mr, wrow[NR], wdrow[NR], nb, x, K, xd, xsum8, y, ldy, ncols, prefetch_ahead):
 *       y[m, c] = sum_b int32(x[m, b] . w[c, b]) * xd[m, b] * wd[c, b] for m < mr, c < ncols,
 *       one tile of NR weight rows (wrow, with their fp16 scales wdrow) and mr activation rows;
 *       prefetch_ahead > 0: also fetch the same blocks that many bytes past each weight row;
 * then includes this header once.
 *
 * Prefill (M >= GEMM_PACK_MIN_ROWS) may take a second route, when the path also defines
 * GEMM_PACKED with gemm_packed_variant() -> const struct gemm_packed_variant * (the micro-kernel
 * this CPU runs, below): each chunk first copies its panel of weights into a packed layout
 * (gemm_pack.h), then tiles of 4 activation rows x 8 weight rows run without any horizontal sum.
 * Both routes do the same float operations per output, in the same order (exact int32 block dots,
 * the scale wd * xd, one fused multiply-add per block), so they give the same bits: a prompt chunk
 * of 512 rows computes each row as a decode step does.
 *
 * A path may also hand the row route's tiles to another ISA's micro-kernel (GEMM_ROWS_RUNNER with
 * gemm_rows_runner() -> gemm_rows_fn or NULL, gemm_rows.h): x86 with VNNI runs decode-sized
 * products on vpdpbusd that way, with gemm_tile's bits.
 *
 * Parallel over chunks of weight rows (and of activation rows in prefill), taken one at a time
 * from the kernels' pool (pool.h): a thread that loses its core leaves its share to the others.
 * A panel (~GEMM_PANEL_BYTES of weights) stays in L2 while
 * every activation tile (MR rows, in L1) meets all its groups, so the activations are
 * re-read only once per panel: for a 512-row prefill that is the difference between
 * streaming the activations ~200 times per GEMM and ~12 times.
 * A row's arithmetic does not depend on its group, panel, tile or thread: results are
 * identical for any thread count and any M (decode and prefill agree).
 */
#include <math.h>
#include <stdlib.h>

#ifndef GEMM_CHUNK_MIN_BYTES
#define GEMM_CHUNK_MIN_BYTES (32 * 1024)
#endif
#ifndef GEMM_CHUNK_ROWS
#define GEMM_CHUNK_ROWS 64
#endif

#include "gemm_pack.h"     /* the packed route, and gemm_block_sum for every route */
#if defined(GEMM_ROWS_RUNNER)
#include "gemm_rows.h"
#endif

/* Constant (is_q4, mr) per call so each tile is specialised and fully unrolled. */
static void gemm_tile_dispatch(int is_q4, int mr, const uint8_t *const wrow[NR],
                               const uint16_t *const wdrow[NR], int64_t nb, const int8_t *x,
                               int64_t K, const float *xd, const int32_t *xsum8, float *y,
                               int64_t ldy, int ncols, int64_t prefetch_ahead)
{
#define TILE(Q4, R) gemm_tile(Q4, R, wrow, wdrow, nb, x, K, xd, xsum8, y, ldy, ncols, prefetch_ahead)
    if (is_q4) {
        switch (mr) {
        case 4: TILE(1, 4); break;
        case 3: TILE(1, 3); break;
        case 2: TILE(1, 2); break;
        default: TILE(1, 1); break;
        }
    } else {
        switch (mr) {
        case 4: TILE(0, 4); break;
        case 3: TILE(0, 3); break;
        case 2: TILE(0, 2); break;
        default: TILE(0, 1); break;
        }
    }
#undef TILE
}

/* xsum8[i] = 8 * the sum of activation block i, for the n blocks of xq. */
static void gemm_fill_xsum8(const int8_t *xq, int64_t n, int32_t *xsum8)
{
    for (int64_t i = 0; i < n; i++)
        xsum8[i] = 8 * gemm_block_sum(xq + i * QK);
}

/* xsum8 int32[M, nb] for a Q4 tile that wants it; NULL otherwise, or out of memory (*failed). */
static int32_t *gemm_xsum8(int is_q4, const int8_t *xq, int64_t M, int64_t nb, int *failed)
{
    *failed = 0;
    if (!is_q4 || !GEMM_Q4_XSUM8)
        return NULL;
    int32_t *xsum8 = malloc((size_t)(M * nb) * sizeof(int32_t));
    if (xsum8 == NULL) {
        *failed = 1;
        return NULL;
    }
    gemm_fill_xsum8(xq, M * nb, xsum8);
    return xsum8;
}

/* One job of the driver: the operands and how the output is cut into chunks, each a panel of
 * `panel` weight groups times a run of `mrows` activation rows (all of them in decode). */
struct gemm_job {
    int is_q4;
    const uint8_t *wq;
    const uint16_t *wd;
    int64_t N, K, M, nb, row_bytes, ngroups, panel, mrows, mchunks;
    const int8_t *xq;
    const float *xd;
    const int32_t *xsum8;
    float *y;
#if defined(GEMM_ROWS_RUNNER)
    gemm_rows_fn rows;                          /* the row route's tile run (gemm_rows.h), or NULL */
    struct gemm_packed_operands rows_pk;        /* its xdT and xinit */
#endif
#if defined(GEMM_PACKED)
    const struct gemm_packed_variant *packed;   /* the packed route's micro-kernel, or NULL */
    struct gemm_packed_operands pk;
    int8_t *pbuf[POOL_MAX_THREADS];             /* each participant's packed panel */
#endif
};

/* A chunk of the row route, into y (the job's, or a worker's copy of it: pool.h pool_run_out). */
static void gemm_chunk_into(const void *ctx, int64_t chunk, float *y)
{
    const struct gemm_job *j = ctx;
    const int64_t p = chunk / j->mchunks, mc = chunk % j->mchunks;
    const int64_t g_end = (p + 1) * j->panel < j->ngroups ? (p + 1) * j->panel : j->ngroups;
    const int64_t m_end = (mc + 1) * j->mrows < j->M ? (mc + 1) * j->mrows : j->M;
    const int64_t N = j->N, K = j->K, nb = j->nb, row_bytes = j->row_bytes;
#if defined(GEMM_ROWS_RUNNER)
    if (j->rows != NULL) {       /* the chunk's rows in one run: it tiles them its own way */
        const int64_t m0 = mc * j->mrows;
        const struct gemm_rows_args a = {
            .is_q4 = j->is_q4, .mr = (int)(m_end - m0), .wq = j->wq, .wd = j->wd, .N = N, .nb = nb,
            .row_bytes = row_bytes, .g0 = p * j->panel, .g1 = g_end, .x = j->xq + m0 * K, .K = K,
            .xdT = j->rows_pk.xdT + (m0 / 4) * nb * 4, .xinit = j->rows_pk.xinit + (m0 / 4) * nb * 4,
            .y = y + m0 * N, .ldy = N, .prefetch = 1};
        j->rows(&a);
        return;
    }
#endif
    for (int64_t m0 = mc * j->mrows; m0 < m_end; m0 += MR) {
        const int mr = m_end - m0 < MR ? (int)(m_end - m0) : MR;
        for (int64_t g = p * j->panel; g < g_end; g++) {
            const int64_t n0 = g * NR;
            const int ncols = N - n0 < NR ? (int)(N - n0) : NR;
            const uint8_t *wrow[NR];
            const uint16_t *wdrow[NR];
            for (int r = 0; r < NR; r++) {
                /* Past the last row, repeat it: computed and thrown away, never out of bounds. */
                const int64_t n = r < ncols ? n0 + r : N - 1;
                wrow[r] = j->wq + n * row_bytes;
                wdrow[r] = j->wd + n * nb;
            }
            /* Only the first pass over a group streams its rows from memory. */
            const int64_t ahead = m0 == mc * j->mrows && g + 1 < g_end ? NR * row_bytes : 0;
            gemm_tile_dispatch(j->is_q4, mr, wrow, wdrow, nb, j->xq + m0 * K, K, j->xd + m0 * nb,
                               j->xsum8 != NULL ? j->xsum8 + m0 * nb : NULL, y + m0 * N + n0, N, ncols,
                               ahead);
        }
    }
}

static void gemm_chunk(void *ctx, int64_t chunk, int participant)
{
    (void)participant;
    gemm_chunk_into(ctx, chunk, ((const struct gemm_job *)ctx)->y);
}

static void gemm_rect(const void *ctx, int64_t chunk, int64_t *m0, int64_t *m1, int64_t *n0, int64_t *n1)
{
    const struct gemm_job *j = ctx;
    pool_panel_rect(chunk, j->mchunks, j->mrows, j->M, j->panel * NR, j->N, m0, m1, n0, n1);
}

/* Decode-sized products on the row route (up to this many rows) run as pool_run_out jobs: they
 * return without waiting for a worker that lost its core. */
#define GEMM_OUT_MAX_ROWS 16

/* Run the row route's job as a pool_run_out job, from one block holding the job and what its chunks
 * read besides the caller's arrays (which the binding holds): the q4 tile's xsum8, or the tile
 * run's per-row operands (a worker the caller took a chunk back from may read them after the call
 * returned). 0 when out of memory for the block. */
static int gemm_run_out(struct gemm_job *job, int nt, int64_t nchunks)
{
#if defined(GEMM_ROWS_RUNNER)
    const int64_t rows_ops = job->rows != NULL ? gemm_packed_row_entries(job->M, job->nb) : 0;
#else
    const int64_t rows_ops = 0;
#endif
    /* xsum8 is gemm_tile's operand only (the row runner folds the offset into xinit) */
    const int64_t sums = rows_ops == 0 && job->is_q4 && GEMM_Q4_XSUM8 ? job->M * job->nb : 0;
    struct gemm_job *blk = malloc(sizeof *blk + (size_t)(sums + 2 * rows_ops) * sizeof(int32_t));
    if (blk == NULL)
        return 0;
    *blk = *job;
    int32_t *const tail = (int32_t *)(blk + 1);
    if (sums > 0) {
        gemm_fill_xsum8(job->xq, sums, tail);
        blk->xsum8 = tail;
    }
#if defined(GEMM_ROWS_RUNNER)
    if (rows_ops > 0) {
        blk->rows_pk.xdT = memcpy(tail, job->rows_pk.xdT, (size_t)rows_ops * sizeof(float));
        blk->rows_pk.xinit = memcpy(tail + rows_ops, job->rows_pk.xinit, (size_t)rows_ops * sizeof(int32_t));
        blk->rows_pk.xabs = NULL;
    }
#endif
    pool_run_out(KERNEL_GEMM, nt, nchunks, gemm_chunk_into, gemm_rect, blk, job->y, job->M, job->N);
    return 1;
}

#if defined(GEMM_PACKED)
/* One chunk of the packed route: pack the panel's strips into this participant's buffer, then run
 * every 4-row tile of the chunk's rows against every strip. Out of memory: NaN in its outputs. */
static void gemm_packed_chunk(void *ctx, int64_t chunk, int participant)
{
    struct gemm_job *j = ctx;
    const int64_t N = j->N, K = j->K, M = j->M, nb = j->nb;
    const int64_t strips = (N + GEMM_STRIP - 1) / GEMM_STRIP;
    const int64_t p = chunk / j->mchunks, mc = chunk % j->mchunks;
    const int64_t s0 = p * j->panel, s1 = s0 + j->panel < strips ? s0 + j->panel : strips;
    const int64_t m_begin = mc * j->mrows, m_end = m_begin + j->mrows < M ? m_begin + j->mrows : M;
    const int64_t strip_bytes = nb * GEMM_STRIP_BLOCK_BYTES;
    if (j->pbuf[participant] == NULL && posix_memalign((void **)&j->pbuf[participant], 64,
                                                       (size_t)(j->panel * strip_bytes)) != 0)
        j->pbuf[participant] = NULL;
    int8_t *buf = j->pbuf[participant];
    if (buf == NULL) {
        for (int64_t m = m_begin; m < m_end; m++)
            for (int64_t n = s0 * GEMM_STRIP; n < N && n < s1 * GEMM_STRIP; n++)
                j->y[m * N + n] = NAN;
        return;
    }
    for (int64_t s = s0; s < s1; s++)
        gemm_pack_strip(j->is_q4, j->wq, j->wd, N, K, s * GEMM_STRIP, j->packed->xor_mask,
                        buf + (s - s0) * strip_bytes);
    float out[4 * GEMM_STRIP];
    for (int64_t m0 = m_begin; m0 < m_end; m0 += 4) {
        const int mr = m_end - m0 < 4 ? (int)(m_end - m0) : 4;
        const int8_t *x[4], *ax[4];
        for (int i = 0; i < 4; i++) {
            /* Past the last row, repeat it: computed and thrown away, never out of bounds. */
            const int64_t m = i < mr ? m0 + i : m0 + mr - 1;
            x[i] = j->xq + m * K;
            ax[i] = j->pk.xabs != NULL ? j->pk.xabs + m * K : NULL;
        }
        const float *xdT = j->pk.xdT + (m0 / 4) * nb * 4;
        const int32_t *xinit = j->pk.xinit != NULL ? j->pk.xinit + (m0 / 4) * nb * 4 : NULL;
        for (int64_t s = s0; s < s1; s++) {
            j->packed->tile(buf + (s - s0) * strip_bytes, nb, x, ax, xdT, xinit, out);
            const int64_t n0 = s * GEMM_STRIP;
            const int ncols = N - n0 < GEMM_STRIP ? (int)(N - n0) : GEMM_STRIP;
            for (int i = 0; i < mr; i++)
                memcpy(j->y + (m0 + i) * N + n0, out + i * GEMM_STRIP, (size_t)ncols * sizeof(float));
        }
    }
}
#endif

static void gemm_simd(int is_q4, const uint8_t *wq, const uint16_t *wd, int64_t N, int64_t K,
                      const int8_t *xq, const float *xd, int64_t M, float *y, int nthreads)
{
    const int64_t nb = K / QK;
    const int64_t row_bytes = is_q4 ? K / 2 : K;
    const int64_t ngroups = (N + NR - 1) / NR;
    int nt = kernels_threads(nthreads);
    if (N * K * M < KERNELS_PARALLEL_MIN_MACS)
        nt = 1;
#if defined(GEMM_PACKED)
    const struct gemm_packed_variant *packed = M >= GEMM_PACK_MIN_ROWS ? gemm_packed_variant() : NULL;
    if (packed != NULL) {
        struct gemm_job job = {.is_q4 = is_q4, .wq = wq, .wd = wd, .N = N, .K = K, .M = M, .nb = nb,
                               .row_bytes = row_bytes, .xq = xq, .xd = xd, .y = y, .packed = packed};
        if (gemm_packed_prepare(&job.pk, packed, xq, xd, M, K)) {
            /* Chunks: a panel of strips (about GEMM_PANEL_BYTES of weights) x a run of rows. */
            const int64_t strips = (N + GEMM_STRIP - 1) / GEMM_STRIP;
            int64_t panel = GEMM_PANEL_BYTES / (GEMM_STRIP * row_bytes);
            panel = panel < 1 ? 1 : panel > strips ? strips : panel;
            job.panel = panel;
            job.mrows = GEMM_PACK_ROWS;
            job.mchunks = (M + GEMM_PACK_ROWS - 1) / GEMM_PACK_ROWS;
            pool_run(KERNEL_GEMM, nt, ((strips + panel - 1) / panel) * job.mchunks, gemm_packed_chunk, &job);
            for (int p = 0; p < POOL_MAX_THREADS; p++)
                free(job.pbuf[p]);
            gemm_packed_release(&job.pk);
            return;
        }
        /* out of memory for the packed route's operands: the row route needs none */
    }
#endif
    /* Chunks: about 16 per thread, between GEMM_CHUNK_MIN_BYTES (the claim of a chunk stays a
     * small part of its time) and one L2 panel; prefill also cuts the rows in runs of
     * GEMM_CHUNK_ROWS, so that a thread that loses its core holds little of the work. */
    const int64_t group_bytes = NR * row_bytes;
    int64_t bytes = ngroups * group_bytes / (16 * (int64_t)nt);
    bytes = bytes < GEMM_CHUNK_MIN_BYTES ? GEMM_CHUNK_MIN_BYTES : bytes > GEMM_PANEL_BYTES ? GEMM_PANEL_BYTES : bytes;
    int64_t panel = bytes / group_bytes;
    if (panel < 1)
        panel = 1;
    const int64_t mrows = M > 2 * GEMM_CHUNK_ROWS ? GEMM_CHUNK_ROWS : M;
    struct gemm_job job = {.is_q4 = is_q4, .wq = wq, .wd = wd, .N = N, .K = K, .M = M, .nb = nb,
                           .row_bytes = row_bytes, .ngroups = ngroups, .panel = panel, .mrows = mrows,
                           .mchunks = (M + mrows - 1) / mrows, .xq = xq, .xd = xd, .y = y};
    int uses_tile = 1;
#if defined(GEMM_ROWS_RUNNER)
    /* Another ISA's tile run when the CPU has one, with the packed route's per-row operands (tiles of
     * 4 rows; MR and the row runs GEMM_CHUNK_ROWS are multiples of 4). Out of memory for them:
     * gemm_tile, which needs none. One row keeps gemm_tile: a transposed strip serves one row only,
     * and a single decode step reads at the memory's rate either way (q4 GEMVs were 15% slower). */
    static const struct gemm_packed_variant rows_operands = {"rows", NULL, 0x80, 0};
    job.rows = M >= 2 ? gemm_rows_runner() : NULL;
    if (job.rows != NULL && !gemm_packed_prepare(&job.rows_pk, &rows_operands, xq, xd, M, K))
        job.rows = NULL;
    uses_tile = job.rows == NULL;
#endif
    const int64_t nchunks = ((ngroups + panel - 1) / panel) * job.mchunks;
    if (M <= GEMM_OUT_MAX_ROWS && gemm_run_out(&job, nt, nchunks)) {
#if defined(GEMM_ROWS_RUNNER)
        if (job.rows != NULL)
            gemm_packed_release(&job.rows_pk);
#endif
        return;
    }
    /* xsum8 is gemm_tile's operand only (the row runner folds the offset into xinit). */
    int failed = 0;
    int32_t *xsum8 = uses_tile ? gemm_xsum8(is_q4, xq, M, nb, &failed) : NULL;
    if (failed) {   /* out of memory: fail loudly in the numbers, not in a crash */
        for (int64_t i = 0; i < M * N; i++)
            y[i] = NAN;
        return;
    }
    job.xsum8 = xsum8;
    pool_run(KERNEL_GEMM, nt, nchunks, gemm_chunk, &job);
#if defined(GEMM_ROWS_RUNNER)
    if (job.rows != NULL)
        gemm_packed_release(&job.rows_pk);
#endif
    free(xsum8);
}

void gemm_q8_simd(const int8_t *wq, const uint16_t *wd, int64_t N, int64_t K,
                  const int8_t *xq, const float *xd, int64_t M, float *y, int nthreads)
{
    gemm_simd(0, (const uint8_t *)wq, wd, N, K, xq, xd, M, y, nthreads);
}

void gemm_q4_simd(const uint8_t *wq, const uint16_t *wd, int64_t N, int64_t K,
                  const int8_t *xq, const float *xd, int64_t M, float *y, int nthreads)
{
    gemm_simd(1, wq, wd, N, K, xq, xd, M, y, nthreads);
}
