/*
 * The portable reference: plain C99, always built, what the SIMD paths are tested against.
 * Kept simple on purpose; where a float sum has an order, it is the obvious one.
 *
 * Integer inputs must lie in [-127, 127] (what the quantizers produce); the SIMD paths
 * rely on it (sign trick), so the reference assumes it too.
 */
#include <math.h>
#include "internal.h"

/* ---- fp16 ---------------------------------------------------------------- */

float fp16_to_fp32(uint16_t h)
{
    return half_to_float(h);
}

/* Round to nearest even, overflow to inf, NaN kept quiet: the float arithmetic does the
 * rounding (scaling moves the value so the float rounding point is the half's), as in
 * Maratyszcza's FP16 library that ggml uses. */
uint16_t fp32_to_fp16(float f)
{
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u)
        bias = 0x71000000u;
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007c00u;
    const uint32_t mantissa_bits = bits & 0x00000fffu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

/* ---- activations ------------------------------------------------------- */

void quantize_rows_q8_portable(const float *x, int64_t M, int64_t K, int8_t *q, float *d)
{
    const int64_t nblocks = M * (K / QK);
    for (int64_t b = 0; b < nblocks; b++)
        d[b] = quantize_group_q8(x + b * QK, QK, q + b * QK);
}

/* ---- GEMM ---------------------------------------------------------------- */

static inline int32_t dot_i8_block(const int8_t *a, const int8_t *b)
{
    int32_t s = 0;
    for (int i = 0; i < QK; i++)
        s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

/* Q4_0 block (16 bytes) -> 32 int8 in [-8, 7]: low nibbles are elements 0..15, high 16..31. */
static inline void unpack_q4_block(const uint8_t *src, int8_t *dst)
{
    for (int j = 0; j < QK / 2; j++) {
        dst[j] = (int8_t)((src[j] & 0x0f) - 8);
        dst[j + QK / 2] = (int8_t)((src[j] >> 4) - 8);
    }
}

/* The reference GEMM, one output feature at a time: chunks of PORTABLE_GEMM_ROWS weight rows. */
#define PORTABLE_GEMM_ROWS 16

struct portable_gemm_job {
    int is_q4;
    const void *wq;
    const uint16_t *wd;
    int64_t N, K, M;
    const int8_t *xq;
    const float *xd;
    float *y;
};

static void portable_gemm_chunk(void *ctx, int64_t chunk, int participant)
{
    (void)participant;
    const struct portable_gemm_job *j = ctx;
    const int64_t nb = j->K / QK;
    const int64_t n_end = (chunk + 1) * PORTABLE_GEMM_ROWS < j->N ? (chunk + 1) * PORTABLE_GEMM_ROWS : j->N;
    for (int64_t n = chunk * PORTABLE_GEMM_ROWS; n < n_end; n++) {
        for (int64_t m = 0; m < j->M; m++) {
            const int8_t *x = j->xq + m * j->K;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int8_t wb[QK];
                const int8_t *w;
                if (j->is_q4) {
                    unpack_q4_block((const uint8_t *)j->wq + n * (j->K / 2) + b * (QK / 2), wb);
                    w = wb;
                } else {
                    w = (const int8_t *)j->wq + n * j->K + b * QK;
                }
                const float scale = j->xd[m * nb + b] * half_to_float(j->wd[n * nb + b]);
                acc += (float)dot_i8_block(x + b * QK, w) * scale;
            }
            j->y[m * j->N + n] = acc;
        }
    }
}

static void portable_gemm(int is_q4, const void *wq, const uint16_t *wd, int64_t N, int64_t K,
                          const int8_t *xq, const float *xd, int64_t M, float *y, int nthreads)
{
    const int nt = N * K * M >= KERNELS_PARALLEL_MIN_MACS ? kernels_threads(nthreads) : 1;
    struct portable_gemm_job job = {is_q4, wq, wd, N, K, M, xq, xd, y};
    pool_run(KERNEL_GEMM, nt, (N + PORTABLE_GEMM_ROWS - 1) / PORTABLE_GEMM_ROWS, portable_gemm_chunk, &job);
}

void gemm_q8_portable(const int8_t *wq, const uint16_t *wd, int64_t N, int64_t K,
                      const int8_t *xq, const float *xd, int64_t M, float *y, int nthreads)
{
    portable_gemm(0, wq, wd, N, K, xq, xd, M, y, nthreads);
}

void gemm_q4_portable(const uint8_t *wq, const uint16_t *wd, int64_t N, int64_t K,
                      const int8_t *xq, const float *xd, int64_t M, float *y, int nthreads)
{
    portable_gemm(1, wq, wd, N, K, xq, xd, M, y, nthreads);
}

/* ---- elementwise ------------------------------------------------------- */

void rmsnorm_portable(const float *x, const float *w, int64_t M, int64_t D, float eps, float *out)
{
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * D;
        float *orow = out + m * D;
        double ss = 0.0;
        for (int64_t i = 0; i < D; i++)
            ss += (double)xr[i] * (double)xr[i];
        const float r = 1.0f / sqrtf((float)(ss / (double)D) + eps);
        for (int64_t i = 0; i < D; i++)
            orow[i] = xr[i] * r * w[i];
    }
}

/* cos/sin are computed once per (token, chunk of frequencies) and reused for every head. */
#define ROPE_CHUNK 64

void rope_portable(float *x, int64_t M, int64_t H, int64_t hd, const int32_t *pos, const float *inv_freq)
{
    const int64_t half = hd / 2;
    float c[ROPE_CHUNK], s[ROPE_CHUNK];
    for (int64_t m = 0; m < M; m++) {
        const float p = (float)pos[m];
        for (int64_t i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
            const int64_t n = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
            for (int64_t i = 0; i < n; i++) {
                const float a = p * inv_freq[i0 + i];
                c[i] = cosf(a);
                s[i] = sinf(a);
            }
            for (int64_t h = 0; h < H; h++) {
                float *xh = x + (m * H + h) * hd + i0;
                for (int64_t i = 0; i < n; i++) {
                    const float x0 = xh[i], x1 = xh[i + half];
                    xh[i] = x0 * c[i] - x1 * s[i];
                    xh[i + half] = x1 * c[i] + x0 * s[i];
                }
            }
        }
    }
}

void silu_mul_portable(const float *gate, const float *up, int64_t n, float *out)
{
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

void layer_norm_portable(const float *x, const float *w, const float *b, int64_t M, int64_t D, float eps,
                         float *out)
{
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * D;
        float *orow = out + m * D;
        double sum = 0.0, ss = 0.0;
        for (int64_t i = 0; i < D; i++)
            sum += xr[i];
        const float mean = (float)(sum / (double)D);
        for (int64_t i = 0; i < D; i++) {
            const double d = (double)xr[i] - (double)mean;
            ss += d * d;
        }
        const float r = 1.0f / sqrtf((float)(ss / (double)D) + eps);
        for (int64_t i = 0; i < D; i++)
            orow[i] = (xr[i] - mean) * r * w[i] + b[i];
    }
}

void gelu_tanh_portable(const float *x, int64_t n, float *out)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = gelu_tanh_one(x[i]);
}

/* ---- attention primitives (see attention_impl.h) --------------------------- */

static void attn_quantize_q(const float *q, int64_t rows, int64_t hd, int8_t *qq, float *qd)
{
    quantize_rows_q8_portable(q, rows, hd, qq, qd);
}

static void attn_scores_q8(const int8_t *qq, const float *qd, int64_t group, int64_t hd,
                           const int8_t *k, const float *ks, int64_t n, float scale,
                           float *s, int64_t ld)
{
    const int64_t nb = hd / QK;
    for (int64_t g = 0; g < group; g++)
        for (int64_t j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++)
                acc += (float)dot_i8_block(qq + g * hd + b * QK, k + j * hd + b * QK) * qd[g * nb + b];
            s[g * ld + j] = acc * (ks[j] * scale);
        }
}

static void attn_scores_q4(const int8_t *qq, const float *qd, int64_t group, int64_t hd,
                           const uint8_t *k, const float *ks, int64_t n, float scale,
                           float *s, int64_t ld, int8_t *work)
{
    (void)work;
    const int64_t nb = hd / QK;
    for (int64_t j = 0; j < n; j++)
        for (int64_t b = 0; b < nb; b++) {
            int8_t kb[QK];
            unpack_q4_block(k + j * (hd / 2) + b * (QK / 2), kb);
            for (int64_t g = 0; g < group; g++) {
                const float part = (float)dot_i8_block(qq + g * hd + b * QK, kb) *
                                   (qd[g * nb + b] * ks[j * nb + b]);
                s[g * ld + j] = b == 0 ? part : s[g * ld + j] + part;
            }
        }
    for (int64_t g = 0; g < group; g++)
        for (int64_t j = 0; j < n; j++)
            s[g * ld + j] *= scale;
}

static void attn_scores_f32(const float *q, int64_t group, int64_t hd, const float *k, int64_t n,
                            float scale, float *s, int64_t ld)
{
    for (int64_t g = 0; g < group; g++)
        for (int64_t j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < hd; d++)
                acc += q[g * hd + d] * k[j * hd + d];
            s[g * ld + j] = acc * scale;
        }
}

static void attn_accum_q8(const int8_t *v, const float *vs, int64_t n, int64_t group, int64_t hd,
                          float *w, int64_t ld, float *acc)
{
    for (int64_t j = 0; j < n; j++)
        for (int64_t g = 0; g < group; g++) {
            const float wv = w[g * ld + j] * vs[j];
            for (int64_t d = 0; d < hd; d++)
                acc[g * hd + d] += wv * (float)v[j * hd + d];
        }
}

static void attn_accum_q4(const uint8_t *v, const float *vs, int64_t n, int64_t group, int64_t hd,
                          float *w, int64_t ld, float *acc)
{
    const int64_t nb = hd / QK;
    for (int64_t j = 0; j < n; j++)
        for (int64_t b = 0; b < nb; b++) {
            int8_t vb[QK];
            unpack_q4_block(v + j * (hd / 2) + b * (QK / 2), vb);
            for (int64_t g = 0; g < group; g++) {
                const float wv = w[g * ld + j] * vs[j * nb + b];
                for (int i = 0; i < QK; i++)
                    acc[g * hd + b * QK + i] += wv * (float)vb[i];
            }
        }
}

static void attn_accum_f32(const float *v, int64_t n, int64_t group, int64_t hd,
                           float *w, int64_t ld, float *acc)
{
    for (int64_t j = 0; j < n; j++)
        for (int64_t g = 0; g < group; g++) {
            const float wj = w[g * ld + j];
            for (int64_t d = 0; d < hd; d++)
                acc[g * hd + d] += wj * v[j * hd + d];
        }
}

static float attn_max(const float *s, int64_t n)
{
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++)
        m = s[j] > m ? s[j] : m;
    return m;
}

static float attn_exp_shift(float *s, int64_t n, float m)
{
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}

static void attn_scale(float *x, int64_t n, float r)
{
    for (int64_t i = 0; i < n; i++)
        x[i] *= r;
}

#define ATTN_NAME(x) x##_portable
#include "attention_impl.h"
