/*
 * AVX-512 attention primitives (with VNNI, 32 registers) for the shared x86 part (attention_x86.h):
 * the int8 scores and the V accumulation, the twins of x86/attention_avx2.h with the same bits.
 * x86/avx512_attention.c includes it under its target pragma.
 *
 * Scores: a block's int32 dot is one vpdpbusd. It wants an unsigned operand, so the key bytes
 * move to unsigned (k ^ 0x80 = k + 128, once per key row for both query heads of a pair) and the
 * lanes start at -128 * (the sum of their four query bytes), kept beside the quantized query: each
 * lane ends at the exact int32 it has on AVX2, and the float steps after it are AVX2's.
 * AVX2 spends a sign, a maddubs and a madd per block and head on the same lanes.
 * V: a row's 128 columns as eight 16-lane vectors, converted once for both query heads, whose
 * accumulators stay in 16 registers; every lane's chain of multiply-adds is AVX2's, in row order.
 */

/* qq[0], qd: quantize_rows_q8; qq[1] holds int32[rows, hd / 4]: for query row r and lane i of
 * block b (its bytes 4i..4i+3), -128 * the sum of those four bytes, the start of the lane's dot. */
static void attn_quantize_q(const float *q, int64_t rows, int64_t hd, int8_t *qq, float *qd)
{
    quantize_rows_q8_simd(q, rows, hd, qq, qd);
    int32_t *start = (int32_t *)(qq + rows * hd);
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    for (int64_t i = 0; i < rows * hd; i += QK) {
        const __m256i sum128 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), bias,
                                                   _mm256_loadu_si256((const __m256i *)(qq + i)));
        _mm256_storeu_si256((__m256i *)(start + i / 4), _mm256_sub_epi32(_mm256_setzero_si256(), sum128));
    }
}

/* One key row against gh (1 or 2) query heads: per head the lane vector AVX2's key_row_dots makes
 * (block dots as floats, each times qd_b or qd_b * ks[b], multiply-added in block order). */
ALWAYS_INLINE void key_row_dots2(const int per_block_ks, const int64_t nb, const int gh, const int8_t *kr,
                                 const float *ksr, const int8_t *const q[2], const int32_t *const st[2],
                                 const float *const qdg[2], __m256 f[2])
{
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    f[0] = f[1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i ku = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(kr + b * QK)), bias);
        for (int h = 0; h < gh; h++) {
            const __m256i d = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)(st[h] + b * 8)), ku,
                                                  _mm256_loadu_si256((const __m256i *)(q[h] + b * QK)));
            const __m256 c = _mm256_set1_ps(per_block_ks ? qdg[h][b] * ksr[b] : qdg[h][b]);
            f[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), c, f[h]);
        }
    }
}

/* Query heads g, g+1 (gh = 2) or g alone against n key rows, eight rows at a time, each head's
 * eight lane vectors summed as AVX2 sums them (hsum8_ps). */
ALWAYS_INLINE void scores_heads(const int per_block_ks, const int64_t nb, const int gh, const int8_t *qq,
                                const float *qd, int64_t group, int64_t g, int64_t hd, const int8_t *k,
                                const float *ks, int64_t n, __m256 vscale, float *s, int64_t ld)
{
    const int32_t *starts = (const int32_t *)(qq + group * hd);
    const int8_t *const q[2] = {qq + g * hd, qq + (g + gh - 1) * hd};
    const int32_t *const st[2] = {starts + g * (hd / 4), starts + (g + gh - 1) * (hd / 4)};
    const float *const qdg[2] = {qd + g * nb, qd + (g + gh - 1) * nb};
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const int cnt = n - j0 < 8 ? (int)(n - j0) : 8;
        /* Rows in pairs, each pair's lane vectors added at once (hsum8_ps's first step), so few
         * vectors are live: the eight rows' vectors of two heads would not fit the registers. */
        __m256 p0[4], p1[4];
        for (int pr = 0; pr < 4; pr++) {
            __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
            __m256 b[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
            const int64_t j = j0 + 2 * pr;
            if (2 * pr < cnt)
                key_row_dots2(per_block_ks, nb, gh, k + j * hd, per_block_ks ? ks + j * nb : NULL, q, st, qdg, a);
            if (2 * pr + 1 < cnt)
                key_row_dots2(per_block_ks, nb, gh, k + (j + 1) * hd, per_block_ks ? ks + (j + 1) * nb : NULL,
                              q, st, qdg, b);
            p0[pr] = _mm256_hadd_ps(a[0], b[0]);
            p1[pr] = _mm256_hadd_ps(a[1], b[1]);
        }
        scores8_store(per_block_ks, hsum8_pairs(p0), ks, j0, cnt, vscale, s + g * ld);
        if (gh == 2)
            scores8_store(per_block_ks, hsum8_pairs(p1), ks, j0, cnt, vscale, s + (g + 1) * ld);
    }
}

/* Scores of query head rows against n int8 key rows k int8[n, hd], as AVX2's scores_int8_nb:
 * q8: s = (sum_b dot_b * qd_b) * (ks[j] * scale); q4: s = (sum_b dot_b * (qd_b * ks[j, b])) * scale.
 * Heads in pairs, which share each key row's loads and its move to unsigned. */
ALWAYS_INLINE void scores_int8_nb(const int per_block_ks, const int64_t nb, const int8_t *qq,
                                  const float *qd, int64_t group, int64_t hd, const int8_t *k,
                                  const float *ks, int64_t n, float scale, float *s, int64_t ld)
{
    const __m256 vscale = _mm256_set1_ps(scale);
    int64_t g = 0;
    for (; g + 2 <= group; g += 2)
        scores_heads(per_block_ks, nb, 2, qq, qd, group, g, hd, k, ks, n, vscale, s, ld);
    if (g < group)
        scores_heads(per_block_ks, nb, 1, qq, qd, group, g, hd, k, ks, n, vscale, s, ld);
}

/* Row j's columns d0 .. d0 + 16 * nv - 1 (d0 a multiple of 32, nv even) as nv float[16] vectors;
 * q4: a block's low nibbles are its columns 0..15, the high ones 16..31. */
ALWAYS_INLINE void load_row_wide(const int kind, const int nv, const void *v, int64_t j, int64_t hd, int64_t d0,
                                 __m512 *f)
{
    if (kind == KV_Q8) {
        const int8_t *r = (const int8_t *)v + j * hd + d0;
        for (int i = 0; i < nv; i++)
            f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r + 16 * i))));
    } else if (kind == KV_Q4) {
        const uint8_t *r = (const uint8_t *)v + j * (hd / 2) + d0 / 2;
        const __m128i mask = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
        for (int i = 0; i < nv; i += 2) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(r + 8 * i));
            const __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, mask), eight);
            const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), eight);
            f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
            f[i + 1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
        }
    } else {
        const float *r = (const float *)v + j * hd + d0;
        for (int i = 0; i < nv; i++)
            f[i] = _mm512_loadu_ps(r + 16 * i);
    }
}

/* acc[r][d0 : d0 + 16 nv] += sum_j w[r][j] * row_j for nr query rows; q4 applies the block scale
 * vs[j, b] to the weight, as AVX2 does. nr * nv accumulators and nv converted columns fit the 32
 * registers: nr * nv <= 16. */
ALWAYS_INLINE void accum_wide(const int kind, const int nr, const int nv, const void *v, const float *vs,
                              int64_t n, int64_t hd, int64_t d0, const float *const w[4], float *const acc[4])
{
    const int64_t nb = hd / QK;
    __m512 a[16];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++)
            a[r * nv + i] = _mm512_loadu_ps(acc[r] + d0 + 16 * i);
    for (int64_t j = 0; j < n; j++) {
        __m512 f[8];
        load_row_wide(kind, nv, v, j, hd, d0, f);
        for (int r = 0; r < nr; r++) {
            for (int i = 0; i < nv; i += 2) {
                const float bs = kind == KV_Q4 ? vs[j * nb + (d0 + 16 * i) / QK] : 1.0f;
                const __m512 p = _mm512_set1_ps(kind == KV_Q4 ? w[r][j] * bs : w[r][j]);
                a[r * nv + i] = _mm512_fmadd_ps(p, f[i], a[r * nv + i]);
                a[r * nv + i + 1] = _mm512_fmadd_ps(p, f[i + 1], a[r * nv + i + 1]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++)
            _mm512_storeu_ps(acc[r] + d0 + 16 * i, a[r * nv + i]);
}

/* nr query rows over all hd columns: 128 at a time for one or two rows (each V row read once), 64
 * for four, then 32 (hd is a multiple of 32). */
ALWAYS_INLINE void accum_rows_wide(const int kind, const int nr, const void *v, const float *vs, int64_t n,
                                   int64_t hd, const float *const w[4], float *const acc[4])
{
    int64_t d0 = 0;
    if (nr <= 2)
        for (; d0 + 128 <= hd; d0 += 128)
            accum_wide(kind, nr, 8, v, vs, n, hd, d0, w, acc);
    for (; d0 + 64 <= hd; d0 += 64)
        accum_wide(kind, nr, 4, v, vs, n, hd, d0, w, acc);
    for (; d0 < hd; d0 += 32)
        accum_wide(kind, nr, 2, v, vs, n, hd, d0, w, acc);
}

/* attention_accum_simd.h's two primitives on the wide loops. */
ALWAYS_INLINE void accum_rows4(const int kind, const void *v, const float *vs, int64_t n, int64_t hd,
                               const float *w, int64_t ld, float *acc)
{
    const float *const wr[4] = {w, w + ld, w + 2 * ld, w + 3 * ld};
    float *const ar[4] = {acc, acc + hd, acc + 2 * hd, acc + 3 * hd};
    accum_rows_wide(kind, 4, v, vs, n, hd, wr, ar);
}

ALWAYS_INLINE void accum_heads(const int kind, const int gh, const void *v, const float *vs, int64_t n,
                               int64_t hd, const float *w0, const float *w1, float *acc0, float *acc1)
{
    const float *const wr[4] = {w0, w1, NULL, NULL};
    float *const ar[4] = {acc0, acc1, NULL, NULL};
    accum_rows_wide(kind, gh, v, vs, n, hd, wr, ar);
}
