/*
 * The strips layout's packer, its scalar twin and its driver (gemm_strips.h, kernels.h).
 *
 * The driver cuts the output like the row route (gemm_driver.h): chunks of strips (and, past
 * STRIPS_RUN_ROWS activation rows, runs of rows), taken one at a time from the kernels' pool, so
 * a thread that loses its core leaves its share to the others. A chunk's strips stay in L2 while
 * each tile of its rows meets them. Results do not depend on the chunking or the thread count.
 */
#include <stdlib.h>
#include "internal.h"
#include "gemm_pack.h"
#include "gemm_strips.h"

#define STRIPS_CHUNK_MIN_BYTES (32 * 1024)
#define STRIPS_PANEL_BYTES (256 * 1024)
#define STRIPS_RUN_ROWS 128

/* The vector micro-kernel of the active GEMM variant, or NULL (x86/avx2.c; dispatch.c elsewhere). */
gemm_strips_fn gemm_strips_runner(void);

int64_t gemm_strips_bytes(int is_q4, int64_t N, int64_t K)
{
    return (N + STRIP_ROWS - 1) / STRIP_ROWS * STRIPS_BYTES(is_q4, K);
}

void gemm_strips_pack(int is_q4, const uint8_t *wq, const uint16_t *wd, int64_t N, int64_t K, uint8_t *ws)
{
    const int64_t nb = K / QK, strips = (N + STRIP_ROWS - 1) / STRIP_ROWS;
    const int64_t strip_bytes = STRIPS_BYTES(is_q4, K), block_bytes = STRIP_BLOCK_BYTES(is_q4);
    const int64_t row_bytes = is_q4 ? K / 2 : K;
    memset(ws, 0, (size_t)(strips * strip_bytes));
    for (int64_t s = 0; s < strips; s++) {
        uint8_t *strip = ws + s * strip_bytes;
        uint16_t *scales = (uint16_t *)(strip + nb * block_bytes);
        for (int r = 0; r < STRIP_ROWS && s * STRIP_ROWS + r < N; r++) {
            const int64_t n = s * STRIP_ROWS + r;
            for (int64_t b = 0; b < nb; b++) {
                uint8_t *dst = strip + b * block_bytes + r * 4;
                if (is_q4) {
                    const uint8_t *src = wq + n * row_bytes + b * (QK / 2);
                    for (int j = 0; j < 4; j++)
                        memcpy(dst + j * 64, src + j * 4, 4);
                } else {
                    const uint8_t *src = wq + n * row_bytes + b * QK;
                    for (int g = 0; g < QK / 4; g++) {
                        uint32_t v;
                        memcpy(&v, src + g * 4, 4);
                        v ^= 0x80808080u;
                        memcpy(dst + g * 64, &v, 4);
                    }
                }
                scales[b * STRIP_ROWS + r] = wd[n * nb + b];
            }
        }
        if (!is_q4)       /* rows past N: w = 0, stored as 0x80 */
            for (int r = (int)(N - s * STRIP_ROWS); r < STRIP_ROWS; r++)
                for (int64_t b = 0; b < nb; b++)
                    for (int g = 0; g < QK / 4; g++)
                        memset(strip + b * block_bytes + g * 64 + r * 4, 0x80, 4);
    }
}

/* The layout's scalar twin: for each strip and row, the block dots of the stored unsigned bytes
 * from the lanes' start, then the vector kernel's float operations (fmaf: a fused multiply-add,
 * in hardware or not). */
static void strips_run_portable(const struct gemm_strips_args *a)
{
    const int64_t nb = a->nb, block_bytes = STRIP_BLOCK_BYTES(a->is_q4);
    for (int64_t s = a->s0; s < a->s1; s++) {
        const uint8_t *strip = a->ws + s * a->strip_bytes;
        const uint16_t *scales = (const uint16_t *)(strip + nb * block_bytes);
        for (int r = 0; r < STRIP_ROWS && s * STRIP_ROWS + r < a->N; r++)
            for (int m = 0; m < a->mr; m++) {
                const int8_t *x = a->x + m * a->K;
                float f = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = strip + b * block_bytes + r * 4;
                    int32_t acc = a->xinit[m * nb + b];
                    for (int g = 0; g < QK / 4; g++)
                        for (int i = 0; i < 4; i++) {
                            const uint8_t u = a->is_q4 ? (g < 4 ? blk[g * 64 + i] & 0x0f : blk[(g - 4) * 64 + i] >> 4)
                                                       : blk[g * 64 + i];
                            acc += (int32_t)u * x[b * QK + g * 4 + i];
                        }
                    const float d = f32_from_bits((uint32_t)acc) - GEMM_FLOAT_MAGIC_F;
                    f = fmaf(d, half_to_float(scales[b * STRIP_ROWS + r]) * a->xd[m * nb + b], f);
                }
                a->y[m * a->ldy + s * STRIP_ROWS + r] = f;
            }
    }
}

/* One job: its block holds the activation sums (xinit) after the struct, so that a worker which lost
 * its core can still read them after the call returned (pool.h pool_run_out). */
struct strips_job {
    struct gemm_strips_args whole;      /* all rows, all strips */
    gemm_strips_fn run;
    int64_t panel, mrows, mchunks;
};

/* Decode-sized products (up to this many rows) return without waiting for a stalled worker. */
#define STRIPS_OUT_MAX_ROWS 16

static void strips_chunk_into(const void *ctx, int64_t chunk, float *y)
{
    const struct strips_job *j = ctx;
    const int64_t strips = (j->whole.N + STRIP_ROWS - 1) / STRIP_ROWS, M = j->whole.mr;
    const int64_t p = chunk / j->mchunks, mc = chunk % j->mchunks;
    const int64_t m0 = mc * j->mrows, m1 = m0 + j->mrows < M ? m0 + j->mrows : M;
    struct gemm_strips_args a = j->whole;
    a.s0 = p * j->panel;
    a.s1 = a.s0 + j->panel < strips ? a.s0 + j->panel : strips;
    a.mr = (int)(m1 - m0);
    a.x += m0 * a.K;
    a.xd += m0 * a.nb;
    a.xinit += m0 * a.nb;
    a.y = y + m0 * a.ldy;
    j->run(&a);
}

static void strips_chunk(void *ctx, int64_t chunk, int participant)
{
    (void)participant;
    const struct strips_job *j = ctx;
    strips_chunk_into(ctx, chunk, j->whole.y);
}

static void strips_rect(const void *ctx, int64_t chunk, int64_t *m0, int64_t *m1, int64_t *n0, int64_t *n1)
{
    const struct strips_job *j = ctx;
    pool_panel_rect(chunk, j->mchunks, j->mrows, j->whole.mr, j->panel * STRIP_ROWS, j->whole.N, m0, m1, n0, n1);
}

static void gemm_strips(int is_q4, const uint8_t *ws, int64_t N, int64_t K, const int8_t *xq, const float *xd,
                        int64_t M, float *y, int nthreads, gemm_strips_fn run)
{
    const int64_t nb = K / QK, strips = (N + STRIP_ROWS - 1) / STRIP_ROWS;
    struct strips_job *job = malloc(sizeof *job + (size_t)(M * nb) * sizeof(int32_t));
    if (job == NULL) {   /* out of memory: fail loudly in the numbers, not in a crash */
        for (int64_t i = 0; i < M * N; i++)
            y[i] = NAN;
        return;
    }
    int32_t *xinit = (int32_t *)(job + 1);
    const int32_t offset = is_q4 ? 8 : 128;
    for (int64_t i = 0; i < M * nb; i++)
        xinit[i] = GEMM_FLOAT_MAGIC - offset * gemm_block_sum(xq + i * QK);
    int nt = kernels_threads(nthreads);
    if (N * K * M < KERNELS_PARALLEL_MIN_MACS)
        nt = 1;
    const int64_t strip_bytes = STRIPS_BYTES(is_q4, K);
    /* about 16 chunks a thread, between STRIPS_CHUNK_MIN_BYTES and one L2 panel */
    int64_t bytes = strips * strip_bytes / (16 * (int64_t)nt);
    bytes = bytes < STRIPS_CHUNK_MIN_BYTES ? STRIPS_CHUNK_MIN_BYTES : bytes > STRIPS_PANEL_BYTES ? STRIPS_PANEL_BYTES : bytes;
    int64_t panel = bytes / strip_bytes;
    panel = panel < 1 ? 1 : panel;
    const int64_t mrows = M > 2 * STRIPS_RUN_ROWS ? STRIPS_RUN_ROWS : M;
    *job = (struct strips_job){
        .whole = {.is_q4 = is_q4, .mr = (int)M, .ws = ws, .N = N, .K = K, .nb = nb, .strip_bytes = strip_bytes,
                  .s0 = 0, .s1 = strips, .x = xq, .xd = xd, .xinit = xinit, .y = y, .ldy = N},
        .run = run, .panel = panel, .mrows = mrows, .mchunks = (M + mrows - 1) / mrows};
    const int64_t nchunks = ((strips + panel - 1) / panel) * job->mchunks;
    if (M <= STRIPS_OUT_MAX_ROWS) {
        pool_run_out(KERNEL_GEMM, nt, nchunks, strips_chunk_into, strips_rect, job, y, M, N);   /* frees job */
    } else {
        pool_run(KERNEL_GEMM, nt, nchunks, strips_chunk, job);
        free(job);
    }
}

void gemm_strips_portable(int is_q4, const uint8_t *ws, int64_t N, int64_t K, const int8_t *xq,
                          const float *xd, int64_t M, float *y, int nthreads)
{
    gemm_strips(is_q4, ws, N, K, xq, xd, M, y, nthreads, strips_run_portable);
}

#if defined(KERNELS_HAVE_SIMD)   /* otherwise dispatch.c maps it to the portable twin */
/* The active variant's micro-kernel where it has one; elsewhere (NEON, the AVX-VNNI variant) the
 * scalar twin, which engines avoid by keeping the row layout there (kernel_gemm_strips_fast). */
void gemm_strips_simd(int is_q4, const uint8_t *ws, int64_t N, int64_t K, const int8_t *xq,
                      const float *xd, int64_t M, float *y, int nthreads)
{
    const gemm_strips_fn run = gemm_strips_runner();
    gemm_strips(is_q4, ws, N, K, xq, xd, M, y, nthreads, run != NULL ? run : strips_run_portable);
}
#endif

int kernel_gemm_strips_fast(void)
{
    return gemm_strips_runner() != NULL;
}
