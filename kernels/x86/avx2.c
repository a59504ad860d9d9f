/*
 * AVX2 + FMA + F16C path: quantize, Q8_0/Q4_0 GEMM/GEMV, rmsnorm, rope, silu_mul.
 * (Attention is in avx2_attention.c and avx512_attention.c.) Compiles to nothing without those extensions.
 */
#include "../internal.h"

#if defined(KERNELS_AVX2)
#include <math.h>
#include "avx2_common.h"

/* ---- activations ------------------------------------------------------- */

void quantize_rows_q8_simd(const float *x, int64_t M, int64_t K, int8_t *q, float *d)
{
    const int64_t nblocks = M * (K / QK);
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    /* packs_epi32/epi16 interleave 128-bit lanes; this puts the 32 bytes back in order. */
    const __m256i unshuffle = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nblocks; b++) {
        const float *xb = x + b * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        const __m256 amax8 = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign_bit, v0), _mm256_andnot_ps(sign_bit, v1)),
            _mm256_max_ps(_mm256_andnot_ps(sign_bit, v2), _mm256_andnot_ps(sign_bit, v3)));
        const float amax = hmax_ps(amax8);
        /* Same float32 operations as the numpy reference, so q and d agree bit for bit;
         * cvtps rounds half to even under the default MXCSR, as np.rint does. */
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vinv));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vinv));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vinv));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vinv));
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)(q + b * QK), _mm256_permutevar8x32_epi32(p, unshuffle));
    }
}

/* ---- KV cache rows ------------------------------------------------------- */

/* quantize_group_q8 of a whole KV row (n a multiple of 32) with the same float32 operations: the
 * same bytes and scale. */
static inline __attribute__((always_inline)) float quantize_kv_row(const float *x, int64_t n, int8_t *q)
{
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256i unshuffle = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8)
        m = _mm256_max_ps(_mm256_andnot_ps(sign_bit, _mm256_loadu_ps(x + i)), m);
    const float amax = hmax_ps(m);
    const __m256 vinv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int64_t i = 0; i < n; i += QK) {
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vinv));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), vinv));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), vinv));
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(p, unshuffle));
    }
    return amax / 127.0f;
}

void kv_store_q8_simd(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                      int8_t *dst, float *scale)
{
    kv_store_q8_rows(x, T, n_kv, hd, slot, bs, dst, scale, quantize_kv_row);
}

/* ---- GEMM ---------------------------------------------------------------- */

/* A tile is NR weight rows x mr (<= MR) activation rows. Per 32-block the NR weight blocks are
 * loaded (and for Q4 unpacked) once and reused for every activation row, each activation block
 * once for the NR weight rows. The four int32 block dots of an activation row reduce to one
 * int32[4] (exact, as the contract sums each block in int32), so one conversion and one FMA
 * apply the two block scales to four outputs. */
#define NR 4
#define MR 4

/* Q4: the nibbles go into maddubs as they are (unsigned 0..15, no sign trick) and the
 * offset comes back as an exact integer: sum (q - 8) x = sum q x - 8 sum x, with
 * xsum8[m, b] = 8 * sum of the activation block, computed once per call. */
ALWAYS_INLINE void gemm_tile(const int is_q4, const int mr, const uint8_t *const wrow[NR],
                             const uint16_t *const wdrow[NR], int64_t nb, const int8_t *x,
                             int64_t K, const float *xd, const int32_t *xsum8, float *y,
                             int64_t ldy, int ncols, int64_t prefetch_ahead)
{
    __m128 acc[MR];   /* acc[m] = y[m, n0..n0+3] */
    for (int m = 0; m < mr; m++)
        acc[m] = _mm_setzero_ps();

    for (int64_t b = 0; b < nb; b++) {
        __m256i w[NR];
        if (prefetch_ahead) {
            /* Each group is a new 4 KB page (for K = 1024) and hardware prefetchers stop at page
             * boundaries: fetch the same block of the next group's rows meanwhile. */
            for (int r = 0; r < NR; r++)
                _mm_prefetch((const char *)(wrow[r] + prefetch_ahead + b * (is_q4 ? QK / 2 : QK)), _MM_HINT_T0);
        }
        for (int r = 0; r < NR; r++) {
            w[r] = is_q4 ? nibbles_q4_32(wrow[r] + b * (QK / 2))
                         : _mm256_loadu_si256((const __m256i *)(wrow[r] + b * QK));
        }
        __m128i h = _mm_cvtsi32_si128(wdrow[0][b]);
        h = _mm_insert_epi16(h, wdrow[1][b], 1);
        h = _mm_insert_epi16(h, wdrow[2][b], 2);
        h = _mm_insert_epi16(h, wdrow[3][b], 3);
        const __m128 wscale = _mm_cvtph_ps(h);               /* wd[n0..n0+3, b] */

        for (int m = 0; m < mr; m++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + m * K + b * QK));
            __m128i dots;
            if (is_q4) {
                dots = _mm_sub_epi32(reduce4_block_i32(dot_u8_i8(w[0], xv), dot_u8_i8(w[1], xv),
                                                       dot_u8_i8(w[2], xv), dot_u8_i8(w[3], xv)),
                                     _mm_set1_epi32(xsum8[m * nb + b]));
            } else {
                /* The activation carries the sign: |x| and four weight blocks take few
                 * registers, so the accumulators are not spilled. */
                const __m256i ax = _mm256_sign_epi8(xv, xv);
                dots = reduce4_block_i32(dot_i8_abs(ax, xv, w[0]), dot_i8_abs(ax, xv, w[1]),
                                         dot_i8_abs(ax, xv, w[2]), dot_i8_abs(ax, xv, w[3]));
            }
            const __m128 s = _mm_mul_ps(wscale, _mm_broadcast_ss(xd + m * nb + b));
            acc[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(dots), s, acc[m]);
        }
    }

    for (int m = 0; m < mr; m++) {
        const __m128 r = acc[m];
        if (ncols == NR) {
            _mm_storeu_ps(y + m * ldy, r);
        } else {
            float tmp[NR];
            _mm_storeu_ps(tmp, r);
            for (int c = 0; c < ncols; c++)
                y[m * ldy + c] = tmp[c];
        }
    }
}

/* ---- the packed route (gemm_pack.h): one micro-kernel source, several dot instructions ---------- */
#include <pthread.h>
#include "../gemm_pack.h"
#include "gemm_vnni.h"

/* AVX2: the sign of x moves onto w, |x| is the unsigned operand (llama.cpp's sign trick). */
#define PACKED_TILE gemm_packed_tile_avx2
#define PACKED_DOT(acc, w, xb, axb) \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(axb, _mm256_sign_epi8(w, xb)), _mm256_set1_epi16(1)))
#define PACKED_WANTS_ABS 1
#define PACKED_XINIT 0
#include "gemm_packed_x86.h"

/* vpdpbusd's arithmetic in AVX2 (each lane += four unsigned x signed byte products, exactly): the
 * VNNI micro-kernels' code and packing, run on any AVX2 CPU, so tests hold them to the others where
 * no CPU with VNNI (or emulator of it) is at hand. */
ALWAYS_INLINE __m256i dpbusd_emulated(__m256i acc, __m256i u, __m256i s)
{
    const __m256i even = _mm256_set1_epi16(0x00ff);
    const __m256i u_even = _mm256_and_si256(u, even), u_odd = _mm256_srli_epi16(u, 8);
    const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even),
                                                  _mm256_madd_epi16(u_odd, s_odd)));
}
#define PACKED_TILE gemm_packed_tile_vnni_emulated
#define PACKED_DOT(acc, w, xb, axb) dpbusd_emulated(acc, w, xb)
#define PACKED_WANTS_ABS 0
#define PACKED_XINIT 1
#include "gemm_packed_x86.h"

/* The row route's tile run on the same emulated dot (gemm_rows.h). */
#define ROWS_RUN gemm_rows_run_vnni_emulated
#define ROWS_DOT(acc, u, s) dpbusd_emulated(acc, u, s)
#define ROWS_MR 8   /* the avx512-vnni tile's shape, spills and all */
#include "gemm_rows_x86.h"

/* The micro-kernels this build has, best first (x86/avx_vnni.c, x86/avx512_vnni.c compile the
 * same sources for vpdpbusd): each a packed route's tile and a row route's tile run (NULL: AVX2's
 * own gemm_tile, inline). "rows" is the row route alone on gemm_tile (no packing): the reference. */
enum { VARIANT_ROWS = -1 };
struct gemm_x86_variant {
    struct gemm_packed_variant packed;
    gemm_rows_fn rows;
    gemm_strips_fn strips;    /* the strips layout's micro-kernel (gemm_strips.h), or NULL */
};
static const struct gemm_x86_variant gemm_variants_x86[] = {
    /* AVX512-VNNI before AVX-VNNI where a CPU has both (Sapphire Rapids, Zen 5): the same vpdpbusd on
     * ymm, but 32 registers: on a Zen 5 EPYC, 2 threads, prefill 512x3072x1024 7.0-7.5 against
     * 7.9-12.7 ms, a decode batch of 8 rows 0.150-0.163 against 0.188-0.256 ms. */
    {{"avx512-vnni", gemm_packed_tile_avx512vnni, 0x80, 0}, gemm_rows_run_avx512vnni, gemm_strips_run_avx512vnni},
    {{"avx-vnni", gemm_packed_tile_avxvnni, 0x80, 0}, gemm_rows_run_avxvnni, NULL},
    {{"avx2", gemm_packed_tile_avx2, 0, 1}, NULL, gemm_strips_run_avx2},
    {{"avx2-vnni-emulated", gemm_packed_tile_vnni_emulated, 0x80, 0}, gemm_rows_run_vnni_emulated, NULL},
};
#define N_VARIANTS (int)(sizeof gemm_variants_x86 / sizeof gemm_variants_x86[0])
#define VARIANT_AVX2 2
#define VARIANT_EMULATED 3

static int variant_cpu_runs(int i)
{
    __builtin_cpu_init();
    switch (i) {
    case 0: return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    case 1: return __builtin_cpu_supports("avxvnni");
    default: return 1;
    }
}

/* Weight rows of the self-check: a 16-row strip (AVX-512's) and an 8-row one. */
enum { ROWS_CHECK_N = 3 * GEMM_STRIP };

enum { CHECK_NBLK = 3, CHECK_K = CHECK_NBLK * QK };

/* What the self-checks hold a run to: gemm_tile's y for activation rows 0-3 (x, xd: 4 rows of
 * CHECK_K) against ROWS_CHECK_N weight rows, q8 or (the same bytes as nibbles) q4. */
static void tile_reference(int is_q4, const int8_t *w, const uint16_t *wd, const int8_t *x, const float *xd,
                           float *want)
{
    const int64_t row_bytes = is_q4 ? CHECK_K / 2 : CHECK_K;
    int32_t xsum8[4 * CHECK_NBLK];
    for (int i = 0; i < 4 * CHECK_NBLK; i++)
        xsum8[i] = 8 * gemm_block_sum(x + i * QK);
    for (int g = 0; g < ROWS_CHECK_N / NR; g++) {
        const uint8_t *wrow[NR];
        const uint16_t *wdrow[NR];
        for (int r = 0; r < NR; r++) {
            wrow[r] = (const uint8_t *)w + (g * NR + r) * row_bytes;
            wdrow[r] = wd + (g * NR + r) * CHECK_NBLK;
        }
        gemm_tile(is_q4, 4, wrow, wdrow, CHECK_NBLK, x, CHECK_K, xd, xsum8, want + g * NR, ROWS_CHECK_N, NR, 0);
    }
}

/* A row route's tile run against gemm_tile, q8 and q4, on ROWS_CHECK_N weight rows, four
 * activation rows and then the last three. */
static int rows_agree(gemm_rows_fn run, const int8_t *w, const uint16_t *wd, const int8_t *x, const float *xd)
{
    enum { NBLK = CHECK_NBLK, K_ = CHECK_K };
    static const struct gemm_packed_variant operands = {"rows", NULL, 0x80, 0};
    struct gemm_packed_operands pk;
    if (!gemm_packed_prepare(&pk, &operands, x, xd, 4, K_))
        return 0;
    int same = 1;
    for (int is_q4 = 0; is_q4 < 2; is_q4++) {
        const int64_t row_bytes = is_q4 ? K_ / 2 : K_;
        float want[4 * ROWS_CHECK_N], got[4 * ROWS_CHECK_N];
        tile_reference(is_q4, w, wd, x, xd, want);
        for (int mr = 4; mr >= 3; mr--) {
            const int m0 = 4 - mr;
            /* rows m0..3 as their own tile: its xdT and xinit start at its first row's lane */
            float xdT[NBLK * 4];
            int32_t xinit[NBLK * 4];
            for (int b = 0; b < NBLK; b++)
                for (int i = 0; i < 4; i++) {
                    const int m = m0 + i < 4 ? m0 + i : 3;
                    xdT[b * 4 + i] = pk.xdT[b * 4 + m];
                    xinit[b * 4 + i] = pk.xinit[b * 4 + m];
                }
            const struct gemm_rows_args a = {.is_q4 = is_q4, .mr = mr, .wq = (const uint8_t *)w, .wd = wd,
                                             .N = ROWS_CHECK_N, .nb = NBLK, .row_bytes = row_bytes, .g0 = 0,
                                             .g1 = ROWS_CHECK_N / NR, .x = x + m0 * K_, .K = K_, .xdT = xdT,
                                             .xinit = xinit, .y = got, .ldy = ROWS_CHECK_N};
            run(&a);
            same &= memcmp(want + m0 * ROWS_CHECK_N, got, (size_t)mr * ROWS_CHECK_N * sizeof(float)) == 0;
        }
    }
    gemm_packed_release(&pk);
    return same;
}

/* A strips micro-kernel against gemm_tile, q8 and q4, on ROWS_CHECK_N weight rows (a whole strip
 * and a part of one), rows 0-3 and then 1-3. */
static int strips_agree(gemm_strips_fn run, const int8_t *w, const uint16_t *wd, const int8_t *x, const float *xd)
{
    enum { NBLK = CHECK_NBLK, K_ = CHECK_K };
    int same = 1;
    for (int is_q4 = 0; is_q4 < 2; is_q4++) {
        uint8_t *ws = NULL;
        if (posix_memalign((void **)&ws, 64, (size_t)gemm_strips_bytes(is_q4, ROWS_CHECK_N, K_)) != 0)
            return 0;
        gemm_strips_pack(is_q4, (const uint8_t *)w, wd, ROWS_CHECK_N, K_, ws);
        float want[4 * ROWS_CHECK_N], got[4 * ROWS_CHECK_N];
        tile_reference(is_q4, w, wd, x, xd, want);
        int32_t xinit[4 * NBLK];
        for (int i = 0; i < 4 * NBLK; i++)
            xinit[i] = GEMM_FLOAT_MAGIC - (is_q4 ? 8 : 128) * gemm_block_sum(x + i * QK);
        for (int m0 = 0; m0 < 2; m0++) {
            memset(got, 0, sizeof got);
            const struct gemm_strips_args a = {
                .is_q4 = is_q4, .mr = 4 - m0, .ws = ws, .N = ROWS_CHECK_N, .K = K_, .nb = NBLK,
                .strip_bytes = STRIPS_BYTES(is_q4, K_), .s0 = 0, .s1 = (ROWS_CHECK_N + STRIP_ROWS - 1) / STRIP_ROWS,
                .x = x + m0 * K_, .xd = xd + m0 * NBLK, .xinit = xinit + m0 * NBLK, .y = got, .ldy = ROWS_CHECK_N};
            run(&a);
            same &= memcmp(want + m0 * ROWS_CHECK_N, got, (size_t)(4 - m0) * ROWS_CHECK_N * sizeof(float)) == 0;
        }
        free(ws);
    }
    return same;
}

/* A micro-kernel this CPU can run must also give the AVX2 kernel's bits on a known case before it
 * is used: a wrong VNNI kernel (which no machine here can execute) then costs speed, not answers. */
static int variant_agrees(int i)
{
    enum { NBLK = 3, K_ = NBLK * QK };
    int8_t wrow[ROWS_CHECK_N][K_], xrow[4][K_], axrow[4][K_];   /* the packed tile reads the first strip */
    uint16_t wd[ROWS_CHECK_N * NBLK];
    float xd[4 * NBLK], xdT[NBLK * 4];
    uint32_t r = 12345u;
    for (int c = 0; c < ROWS_CHECK_N; c++)
        for (int k = 0; k < K_; k++) {
            r = r * 1103515245u + 12345u;
            wrow[c][k] = (int8_t)((int)(r >> 16) % 255 - 127);
        }
    for (int m = 0; m < 4; m++)
        for (int k = 0; k < K_; k++) {
            r = r * 1103515245u + 12345u;
            xrow[m][k] = (int8_t)((int)(r >> 16) % 255 - 127);
            axrow[m][k] = (int8_t)(xrow[m][k] < 0 ? -xrow[m][k] : xrow[m][k]);
        }
    for (int n = 0; n < ROWS_CHECK_N * NBLK; n++)
        wd[n] = (uint16_t)(0x3000 + 37 * n);     /* halves from 0.125 up */
    for (int n = 0; n < 4 * NBLK; n++)
        xd[n] = 0.01f * (float)(n + 1);
    for (int b = 0; b < NBLK; b++)
        for (int m = 0; m < 4; m++)
            xdT[b * 4 + m] = xd[m * NBLK + b];
    float out[2][4 * GEMM_STRIP];
    for (int pass = 0; pass < 2; pass++) {
        const struct gemm_packed_variant *v = &gemm_variants_x86[pass ? i : VARIANT_AVX2].packed;
        int8_t packed[NBLK * GEMM_STRIP_BLOCK_BYTES] __attribute__((aligned(64)));
        gemm_pack_strip(0, (const uint8_t *)wrow, wd, GEMM_STRIP, K_, 0, v->xor_mask, packed);
        const int8_t *x[4] = {xrow[0], xrow[1], xrow[2], xrow[3]};
        const int8_t *ax[4] = {axrow[0], axrow[1], axrow[2], axrow[3]};
        int32_t xinit[NBLK * 4];
        for (int b = 0; b < NBLK; b++)
            for (int m = 0; m < 4; m++)
                xinit[b * 4 + m] = GEMM_FLOAT_MAGIC - (int32_t)v->xor_mask * gemm_block_sum(xrow[m] + b * QK);
        v->tile(packed, NBLK, x, ax, xdT, v->xor_mask ? xinit : NULL, out[pass]);
    }
    if (memcmp(out[0], out[1], sizeof out[0]) != 0)
        return 0;
    if (gemm_variants_x86[i].strips != NULL &&
        !strips_agree(gemm_variants_x86[i].strips, &wrow[0][0], wd, &xrow[0][0], xd))
        return 0;
    return gemm_variants_x86[i].rows == NULL || rows_agree(gemm_variants_x86[i].rows, &wrow[0][0], wd, &xrow[0][0], xd);
}

static int variant_ok[N_VARIANTS];      /* 1: this CPU runs it and it agreed */
static int variant_active = VARIANT_AVX2;
static pthread_once_t variants_once = PTHREAD_ONCE_INIT;

static void choose_variant(void)
{
    int best = -1;
    for (int i = 0; i < N_VARIANTS; i++) {
        variant_ok[i] = variant_cpu_runs(i) && variant_agrees(i);
        if (best < 0 && variant_ok[i] && i != VARIANT_EMULATED)
            best = i;
    }
    variant_active = best;
}

static const struct gemm_packed_variant *gemm_packed_variant(void)
{
    pthread_once(&variants_once, choose_variant);
    const int v = __atomic_load_n(&variant_active, __ATOMIC_RELAXED);
    return v >= 0 ? &gemm_variants_x86[v].packed : NULL;
}
#define GEMM_PACKED 1

/* The active variant's row route tile run, or NULL for gemm_tile (the "rows" and "avx2" variants). */
static gemm_rows_fn gemm_rows_runner(void)
{
    pthread_once(&variants_once, choose_variant);
    const int v = __atomic_load_n(&variant_active, __ATOMIC_RELAXED);
    return v >= 0 ? gemm_variants_x86[v].rows : NULL;
}
#define GEMM_ROWS_RUNNER 1

/* The active variant's strips micro-kernel (strips.c), or NULL: weights then stay in rows. */
gemm_strips_fn gemm_strips_runner(void)
{
    pthread_once(&variants_once, choose_variant);
    const int v = __atomic_load_n(&variant_active, __ATOMIC_RELAXED);
    return v >= 0 ? gemm_variants_x86[v].strips : NULL;
}

const char *kernel_gemm_variant(void)
{
    const struct gemm_packed_variant *v = gemm_packed_variant();
    return v != NULL ? v->name : "rows";
}

const char *kernel_gemm_variants(void)
{
    static char buf[128];
    pthread_once(&variants_once, choose_variant);
    strcpy(buf, "rows");
    for (int i = 0; i < N_VARIANTS; i++)
        if (variant_ok[i]) {
            strcat(buf, " ");
            strcat(buf, gemm_variants_x86[i].packed.name);
        }
    return buf;
}

int kernel_set_gemm_variant(const char *name)
{
    pthread_once(&variants_once, choose_variant);
    if (strcmp(name, "rows") == 0) {
        __atomic_store_n(&variant_active, VARIANT_ROWS, __ATOMIC_RELAXED);
        return 0;
    }
    for (int i = 0; i < N_VARIANTS; i++)
        if (variant_ok[i] && strcmp(name, gemm_variants_x86[i].packed.name) == 0) {
            __atomic_store_n(&variant_active, i, __ATOMIC_RELAXED);
            return 0;
        }
    return -1;
}

/* Weight panels that stay in L2 with the activation tile (gemm_driver.h). */
#define GEMM_PANEL_BYTES (256 * 1024)
#define GEMM_Q4_XSUM8 1
#include "../gemm_driver.h"

/* ---- elementwise ------------------------------------------------------- */

/* sum_i (x[i] - c)^2 over a row (rmsnorm: c = 0, and x - 0 is x; layer_norm: c = the mean). */
static float sum_sq_around(const float *xr, int64_t D, float c)
{
    const __m256 vc = _mm256_set1_ps(c);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= D; i += 16) {
        const __m256 a = _mm256_sub_ps(_mm256_loadu_ps(xr + i), vc), b = _mm256_sub_ps(_mm256_loadu_ps(xr + i + 8), vc);
        s0 = _mm256_fmadd_ps(a, a, s0);
        s1 = _mm256_fmadd_ps(b, b, s1);
    }
    for (; i + 8 <= D; i += 8) {
        const __m256 a = _mm256_sub_ps(_mm256_loadu_ps(xr + i), vc);
        s0 = _mm256_fmadd_ps(a, a, s0);
    }
    float ss = hsum_ps(_mm256_add_ps(s0, s1));
    for (; i < D; i++)
        ss += (xr[i] - c) * (xr[i] - c);
    return ss;
}

void rmsnorm_simd(const float *x, const float *w, int64_t M, int64_t D, float eps, float *out)
{
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * D;
        float *orow = out + m * D;
        const float ss = sum_sq_around(xr, D, 0.0f);
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        const __m256 vr = _mm256_set1_ps(r);
        int64_t i;
        for (i = 0; i + 8 <= D; i += 8)
            _mm256_storeu_ps(orow + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vr),
                                                     _mm256_loadu_ps(w + i)));
        for (; i < D; i++)
            orow[i] = xr[i] * r * w[i];
    }
}

#define ROPE_CHUNK 64

/* cos/sin come from libm (the same calls as the portable path: positions reach 40k radians,
 * where a cheap vector sincos loses digits); the rotation itself is vectorised. */
void rope_simd(float *x, int64_t M, int64_t H, int64_t hd, const int32_t *pos, const float *inv_freq)
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
                int64_t i = 0;
                for (; i + 8 <= n; i += 8) {
                    const __m256 x0 = _mm256_loadu_ps(xh + i), x1 = _mm256_loadu_ps(xh + i + half);
                    const __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
                    _mm256_storeu_ps(xh + i, _mm256_sub_ps(_mm256_mul_ps(x0, vc), _mm256_mul_ps(x1, vs)));
                    _mm256_storeu_ps(xh + i + half, _mm256_add_ps(_mm256_mul_ps(x1, vc), _mm256_mul_ps(x0, vs)));
                }
                for (; i < n; i++) {
                    const float x0 = xh[i], x1 = xh[i + half];
                    xh[i] = x0 * c[i] - x1 * s[i];
                    xh[i + half] = x1 * c[i] + x0 * s[i];
                }
            }
        }
    }
}

void silu_mul_simd(const float *gate, const float *up, int64_t n, float *out)
{
    const __m256 one = _mm256_set1_ps(1.0f), sign_bit = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp_ps(_mm256_xor_ps(g, sign_bit));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                                _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

/* Two passes over the row: its mean, then the squares around it (one pass of sum and sum of
 * squares loses digits when the mean is large against the spread). */
void layer_norm_simd(const float *x, const float *w, const float *b, int64_t M, int64_t D, float eps,
                     float *out)
{
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * D;
        float *orow = out + m * D;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= D; i += 16) {
            s0 = _mm256_add_ps(s0, _mm256_loadu_ps(xr + i));
            s1 = _mm256_add_ps(s1, _mm256_loadu_ps(xr + i + 8));
        }
        for (; i + 8 <= D; i += 8)
            s0 = _mm256_add_ps(s0, _mm256_loadu_ps(xr + i));
        float sum = hsum_ps(_mm256_add_ps(s0, s1));
        for (; i < D; i++)
            sum += xr[i];
        const float mean = sum / (float)D;
        const __m256 vmean = _mm256_set1_ps(mean);
        const float r = 1.0f / sqrtf(sum_sq_around(xr, D, mean) / (float)D + eps);
        const __m256 vr = _mm256_set1_ps(r);
        for (i = 0; i + 8 <= D; i += 8) {
            const __m256 n = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + i), vmean), vr);
            _mm256_storeu_ps(orow + i, _mm256_fmadd_ps(n, _mm256_loadu_ps(w + i), _mm256_loadu_ps(b + i)));
        }
        for (; i < D; i++)
            orow[i] = (xr[i] - mean) * r * w[i] + b[i];
    }
}

/* Below GELU_TANH_LOW the result is below 1e-37: x is raised to it, since exp_ps clamps its
 * argument and x / (1 + exp(88.7)) would not vanish for x near -3e38 (kernels.h). */
void gelu_tanh_simd(const float *x, int64_t n, float *out)
{
    const __m256 one = _mm256_set1_ps(1.0f), c3 = _mm256_set1_ps(GELU_TANH_C3);
    const __m256 k = _mm256_set1_ps(GELU_TANH_K), low = _mm256_set1_ps(GELU_TANH_LOW);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_max_ps(_mm256_loadu_ps(x + i), low);
        const __m256 z = _mm256_fmadd_ps(_mm256_mul_ps(c3, v), _mm256_mul_ps(v, v), v);
        const __m256 e = exp_ps(_mm256_mul_ps(k, z));
        _mm256_storeu_ps(out + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
    }
    for (; i < n; i++)
        out[i] = gelu_tanh_one(x[i]);
}

#endif /* KERNELS_AVX2 */
