/*
 * Standalone check of the SIMD path against the portable reference, no Python needed:
 * for cross builds run under qemu before the full pytest harness exists, e.g.
 *
 *   aarch64-linux-gnu-gcc -O2 -march=armv8.2-a+dotprod+fp16 -fopenmp -ffp-contract=off -std=gnu11 \
 *     -Ikernels -static tests/kernels/c/check_simd.c $(find kernels -maxdepth 1 -name '*.c' ! -name kernels.c) \
 *     kernels/arm/neon.c kernels/arm/neon_attention.c -lm -lpthread -o /tmp/check_simd
 *   qemu-aarch64-static -cpu cortex-a76 /tmp/check_simd      (exit 0 = every check passed)
 *
 * Tolerances are those of tests/kernels (GEMM: 1e-5 of sum |block terms|; attention: 2e-5 of
 * max|V|, for q8 plus 8 * 2^-bits when the path sums V with integer weights); quantize_rows_q8
 * must be bit-identical. The Python tests remain the reference.
 */
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"

static int failures = 0;
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static float frand(void)   /* uniform in [-1, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((rng_state >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}

/* max_i |a_i - b_i| / (|a_i| * rel + floor); noinline: aarch64 gcc 12 -O2 ICEs vectorising
 * these fmax reductions inline. */
__attribute__((noinline)) static double max_err(const float *a, const float *b, int64_t n,
                                                double rel, double floor_)
{
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double e = isfinite(b[i]) ? fabs((double)a[i] - b[i]) / (fabs(a[i]) * rel + floor_)
                                        : INFINITY;
        if (e > worst)
            worst = e;
    }
    return worst;
}

/* A decode-sized GEMM or attention call may return while a worker that lost its core still reads
 * its operands (kernels.h, kernel_pool_last_stale): free them only once it has left. */
static void wait_for_late_workers(void)
{
    const uint64_t job = kernel_pool_last_stale();
    while (job != 0 && !kernel_pool_released(job))
        sched_yield();
}

static void check(int ok, const char *what, double detail)
{
    if (!ok) {
        failures++;
        printf("FAIL %s (%g)\n", what, detail);
    }
}

__attribute__((noinline)) static void check_quantize(int64_t M, int64_t K)
{
    float *x = malloc(sizeof(float) * M * K);
    int8_t *q0 = malloc(M * K), *q1 = malloc(M * K);
    float *d0 = malloc(sizeof(float) * M * K / QK), *d1 = malloc(sizeof(float) * M * K / QK);
    for (int64_t i = 0; i < M * K; i++)
        x[i] = frand() * 10.0f;
    for (int i = 0; i < QK && M * K >= 2 * QK; i++)
        x[QK + i] = (float)i - 15.5f;   /* ties */
    quantize_rows_q8_portable(x, M, K, q0, d0);
    quantize_rows_q8_simd(x, M, K, q1, d1);
    check(memcmp(q0, q1, M * K) == 0 && memcmp(d0, d1, sizeof(float) * M * K / QK) == 0,
          "quantize_rows_q8 bit-identical", (double)K);
    wait_for_late_workers();
    free(x); free(q0); free(q1); free(d0); free(d1);
}

__attribute__((noinline)) static void check_gemm(int is_q4, int64_t M, int64_t N, int64_t K)
{
    const int64_t nb = K / QK, wbytes = is_q4 ? K / 2 : K;
    uint8_t *w = malloc(N * wbytes);
    uint16_t *wd = malloc(sizeof(uint16_t) * N * nb);
    int8_t *xq = malloc(M * K);
    float *xd = malloc(sizeof(float) * M * nb), *y0 = malloc(sizeof(float) * M * N),
          *y1 = malloc(sizeof(float) * M * N);
    for (int64_t i = 0; i < N * wbytes; i++)
        w[i] = is_q4 ? (uint8_t)(frand() * 128 + 128) : (uint8_t)(int8_t)(frand() * 127);
    for (int64_t i = 0; i < N * nb; i++)
        wd[i] = fp32_to_fp16(0.01f + 0.01f * frand());
    for (int64_t i = 0; i < M * K; i++)
        xq[i] = (int8_t)(frand() * 127);
    for (int64_t i = 0; i < M * nb; i++)
        xd[i] = 0.02f + 0.01f * frand();
    if (is_q4) {
        gemm_q4_portable(w, wd, N, K, xq, xd, M, y0, 2);
        gemm_q4_simd(w, wd, N, K, xq, xd, M, y1, 2);
    } else {
        gemm_q8_portable((int8_t *)w, wd, N, K, xq, xd, M, y0, 2);
        gemm_q8_simd((int8_t *)w, wd, N, K, xq, xd, M, y1, 2);
    }
    double worst = 0.0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double bound = 0.0;   /* sum_b |dot_b * scale_b|, the scale of the rounding */
            for (int64_t b = 0; b < nb; b++) {
                int32_t dot = 0;
                for (int i = 0; i < QK; i++) {
                    const int8_t *wr = (const int8_t *)w + n * wbytes;
                    const uint8_t *w4 = w + n * wbytes + b * (QK / 2);
                    const int wi = is_q4 ? (i < QK / 2 ? (w4[i] & 15) : (w4[i - QK / 2] >> 4)) - 8
                                         : wr[b * QK + i];
                    dot += wi * xq[m * K + b * QK + i];
                }
                bound += fabs((double)dot * xd[m * nb + b] * fp16_to_fp32(wd[n * nb + b]));
            }
            const double err = fabs((double)y0[m * N + n] - y1[m * N + n]) / (bound + 1e-30);
            worst = err > worst ? err : worst;
            if (!isfinite(y1[m * N + n]))
                worst = INFINITY;
        }
    char what[96];
    snprintf(what, sizeof what, "gemm_%s M=%lld N=%lld K=%lld", is_q4 ? "q4" : "q8",
             (long long)M, (long long)N, (long long)K);
    check(worst <= 1e-5, what, worst);
    wait_for_late_workers();
    free(w); free(wd); free(xq); free(xd); free(y0); free(y1);
}

__attribute__((noinline)) static void check_elementwise(void)
{
    enum { M = 5, D = 203, H = 3, HD = 128 };
    static float x[M * D], w[D], o0[M * D], o1[M * D], r0[M * H * HD], r1[M * H * HD], fr[HD / 2];
    static int32_t pos[M];
    for (int i = 0; i < M * D; i++)
        x[i] = frand() * 30.0f;
    for (int i = 0; i < D; i++)
        w[i] = frand();
    rmsnorm_portable(x, w, M, D, 1e-6f, o0);
    rmsnorm_simd(x, w, M, D, 1e-6f, o1);
    double worst = max_err(o0, o1, M * D, 1.0, 1e-6);
    check(worst < 2e-6, "rmsnorm", worst);

    silu_mul_portable(x, w, D, o0);
    silu_mul_simd(x, w, D, o1);
    worst = max_err(o0, o1, D, 1.0, 1e-30);
    check(worst < 2e-6, "silu_mul", worst);

    for (int i = 0; i < M * H * HD; i++)
        r0[i] = r1[i] = frand();
    for (int i = 0; i < HD / 2; i++)
        fr[i] = powf(1e6f, -2.0f * i / HD);
    for (int m = 0; m < M; m++)
        pos[m] = 1000 * m + 7;
    rope_portable(r0, M, H, HD, pos, fr);
    rope_simd(r1, M, H, HD, pos, fr);
    worst = max_err(r0, r1, M * H * HD, 0.0, 1.0);
    check(worst < 1e-6, "rope", worst);
}

/* kind 0 = q8, 1 = q4, 2 = f32 */
__attribute__((noinline)) static void check_attention(int kind, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                            int64_t bs, int64_t ctx, int per_head)
{
    const int64_t nlog = (ctx + bs - 1) / bs, nblk = nlog + 2, nb = hd / QK;
    const int64_t rows = nblk * n_kv * bs, Hq = n_kv * group;
    const int64_t rbytes = kind == 1 ? hd / 2 : kind == 0 ? hd : hd * 4;
    const int64_t nscale = kind == 1 ? nb : 1;
    uint8_t *k = malloc(rows * rbytes), *v = malloc(rows * rbytes);
    float *ks = malloc(sizeof(float) * rows * nscale), *vs = malloc(sizeof(float) * rows * nscale);
    float *q = malloc(sizeof(float) * T * Hq * hd), *o0 = malloc(sizeof(float) * T * Hq * hd),
          *o1 = malloc(sizeof(float) * T * Hq * hd);
    const int64_t stride = per_head ? nlog : 0, ntab = per_head ? n_kv * nlog : nlog;
    int32_t *table = malloc(4 * ntab), *bpos = malloc(4 * ntab), *count = malloc(4 * ntab),
            *qpos = malloc(4 * T);
    for (int64_t i = 0; i < rows * rbytes; i++) {
        k[i] = (uint8_t)(int8_t)(frand() * 127);
        v[i] = (uint8_t)(int8_t)(frand() * 127);
    }
    if (kind == 2)
        for (int64_t i = 0; i < rows * hd; i++) {
            ((float *)k)[i] = frand();
            ((float *)v)[i] = frand();
        }
    for (int64_t i = 0; i < rows * nscale; i++) {
        ks[i] = 0.02f * (1.5f + frand());
        vs[i] = 0.01f * (1.5f + frand());
    }
    for (int64_t i = 0; i < T * Hq * hd; i++)
        q[i] = frand() * 2.0f;
    for (int64_t i = 0; i < ntab; i++) {
        const int64_t lb = i % nlog;
        table[i] = (int32_t)((lb * 7 + 1 + (per_head ? i / nlog : 0)) % nblk);   /* scattered */
        bpos[i] = (int32_t)lb;
        count[i] = (int32_t)(lb == nlog - 1 ? ctx - lb * bs : bs);
    }
    for (int64_t t = 0; t < T; t++)
        qpos[t] = (int32_t)(ctx - T + t);
    const float scale = 1.0f / sqrtf((float)hd);
    if (kind == 0) {
        attention_q8_portable(q, T, n_kv, group, hd, (int8_t *)k, ks, (int8_t *)v, vs, bs, table, bpos,
                              count, nlog, stride, qpos, scale, o0, 2);
        attention_q8_simd(q, T, n_kv, group, hd, (int8_t *)k, ks, (int8_t *)v, vs, bs, table, bpos,
                          count, nlog, stride, qpos, scale, o1, 2);
    } else if (kind == 1) {
        attention_q4_portable(q, T, n_kv, group, hd, k, ks, v, vs, bs, table, bpos, count, nlog,
                              stride, qpos, scale, o0, 2);
        attention_q4_simd(q, T, n_kv, group, hd, k, ks, v, vs, bs, table, bpos, count, nlog,
                          stride, qpos, scale, o1, 2);
    } else {
        attention_f32_portable(q, T, n_kv, group, hd, (float *)k, (float *)v, bs, table, bpos,
                               count, nlog, stride, qpos, scale, o0, 2);
        attention_f32_simd(q, T, n_kv, group, hd, (float *)k, (float *)v, bs, table, bpos, count,
                           nlog, stride, qpos, scale, o1, 2);
    }
    const double vmax = kind == 2 ? 1.0 : 127.0 * 0.025 * (kind == 1 ? 8.0 / 127.0 : 1.0);
    const double worst = max_err(o0, o1, T * Hq * hd, 0.0, vmax);
    char what[96];
    snprintf(what, sizeof what, "attention_%s T=%lld n_kv=%lld group=%lld hd=%lld ctx=%lld",
             kind == 0 ? "q8" : kind == 1 ? "q4" : "f32", (long long)T, (long long)n_kv,
             (long long)group, (long long)hd, (long long)ctx);
    /* q8 on NEON sums V with integer weights (kernels.h kernel_attention_tolerance) */
    check(worst <= kernel_attention_tolerance(kind == 0 ? kernel_attention_q8_weight_bits() : 0), what, worst);
    wait_for_late_workers();
    free(k); free(v); free(ks); free(vs); free(q); free(o0); free(o1);
    free(table); free(bpos); free(count); free(qpos);
}

int main(void)
{
    printf("path=%s supported=%d features='%s'\n", kernel_path(), kernel_cpu_supported(),
           kernel_cpu_features());
    check_quantize(3, 32);
    check_quantize(5, 1024);
    const int64_t shapes[][3] = {{1, 1, 32}, {1, 3, 64}, {2, 33, 1024}, {5, 8, 3072}, {16, 257, 64}, {1, 4099, 64}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int q4 = 0; q4 < 2; q4++)
            check_gemm(q4, shapes[i][0], shapes[i][1], shapes[i][2]);
    check_elementwise();
    for (int kind = 0; kind < 3; kind++) {
        check_attention(kind, 1, 8, 2, 128, 32, 300, 0);
        check_attention(kind, 3, 2, 4, 64, 16, 77, 1);
        check_attention(kind, 17, 1, 1, 128, 8, 45, 0);
        check_attention(kind, 5, 2, 3, 256, 32, 100, 1);
    }
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "ok", failures);
    return failures != 0;
}
