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
 * Parallel over panels of weight rows, static chunks: each thread streams its own slice of
 * the weights from memory once. A panel (~GEMM_PANEL_BYTES of weights) stays in L2 while
 * every activation tile (MR rows, in L1) meets all its groups, so the activations are
 * re-read only once per panel: for a 512-row prefill that is the difference between
 * streaming the activations ~200 times per GEMM and ~12 times.
 * A row's arithmetic does not depend on its group, panel, tile or thread: results are
 * identical for any thread count and any M (decode and prefill agree).
 */
#include <math.h>
#include <stdlib.h>

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
    for (int64_t i = 0; i < M * nb; i++) {
        int32_t sum = 0;
        for (int j = 0; j < QK; j++)
            sum += xq[i * QK + j];
        xsum8[i] = 8 * sum;
    }
    return xsum8;
}

static void gemm_simd(int is_q4, const uint8_t *wq, const uint16_t *wd, int64_t N, int64_t K,
                      const int8_t *xq, const float *xd, int64_t M, float *y, int nthreads)
{
    const int64_t nb = K / QK;
    const int64_t row_bytes = is_q4 ? K / 2 : K;
    const int64_t ngroups = (N + NR - 1) / NR;
    const int nt = kernels_threads(nthreads);
    int64_t panel = GEMM_PANEL_BYTES / (NR * row_bytes);
    if (panel > (ngroups + nt - 1) / nt)
        panel = (ngroups + nt - 1) / nt;   /* every thread gets work */
    if (panel < 1)
        panel = 1;
    const int64_t npanels = (ngroups + panel - 1) / panel;
    int failed;
    int32_t *xsum8 = gemm_xsum8(is_q4, xq, M, nb, &failed);
    if (failed) {   /* out of memory: fail loudly in the numbers, not in a crash */
        for (int64_t i = 0; i < M * N; i++)
            y[i] = NAN;
        return;
    }
    #pragma omp parallel num_threads(nt) if (nt > 1 && N * K * M >= KERNELS_PARALLEL_MIN_MACS)
    {
    kernels_note_threads(KERNEL_GEMM);
    #pragma omp for schedule(static)
    for (int64_t p = 0; p < npanels; p++) {
        const int64_t g_end = (p + 1) * panel < ngroups ? (p + 1) * panel : ngroups;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? (int)(M - m0) : MR;
            for (int64_t g = p * panel; g < g_end; g++) {
                const int64_t n0 = g * NR;
                const int ncols = N - n0 < NR ? (int)(N - n0) : NR;
                const uint8_t *wrow[NR];
                const uint16_t *wdrow[NR];
                for (int r = 0; r < NR; r++) {
                    /* Past the last row, repeat it: computed and thrown away, never out of bounds. */
                    const int64_t n = r < ncols ? n0 + r : N - 1;
                    wrow[r] = wq + n * row_bytes;
                    wdrow[r] = wd + n * nb;
                }
                /* Only the first pass over a group streams its rows from memory. */
                const int64_t ahead = m0 == 0 && g + 1 < ngroups ? NR * row_bytes : 0;
                gemm_tile_dispatch(is_q4, mr, wrow, wdrow, nb, xq + m0 * K, K, xd + m0 * nb,
                                   xsum8 != NULL ? xsum8 + m0 * nb : NULL, y + m0 * N + n0, N, ncols, ahead);
            }
        }
    }
    }   /* parallel */
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
