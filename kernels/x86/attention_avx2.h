/*
 * AVX2 attention primitives for the shared x86 part (attention_x86.h): the int8 scores and the V
 * accumulation (x86/avx2_attention.c includes it; x86/attention_avx512.h is the AVX-512 twin).
 *
 * Scores: per key row, each 32-block's exact int32 dot stays in eight lanes, converted and scaled
 * by qd_b (x ks_b for q4) lane by lane; eight rows' vectors are then summed horizontally together.
 * V: 32 columns at a time with the accumulators of one or two query heads in registers, every V
 * row converted to float once for both heads.
 */

static void attn_quantize_q(const float *q, int64_t rows, int64_t hd, int8_t *qq, float *qd)
{
    quantize_rows_q8_simd(q, rows, hd, qq, qd);
    /* qq[1] = |qq[0]|: the unsigned operand of the sign-trick dots, reused for every key row. */
    int8_t *aq = qq + rows * hd;
    for (int64_t i = 0; i < rows * hd; i += QK) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qq + i));
        _mm256_storeu_si256((__m256i *)(aq + i), _mm256_sign_epi8(v, v));
    }
}

/* One key row against one query head: its block dots as floats, each times its block scale,
 * lane by lane (qd_b, or qd_b * ks[b] with per-block key scales); the caller sums the lanes.
 * No horizontal sum per block: a block's int32 dot is exact in any lane order, and the lanes
 * are added once per row, eight rows together. */
ALWAYS_INLINE __m256 key_row_dots(const int per_block_ks, const int64_t nb, const int8_t *aq, const int8_t *qg,
                                  const float *qdg, const int8_t *kr, const float *ksr)
{
    __m256 f = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i d = dot_i8_abs(_mm256_loadu_si256((const __m256i *)(aq + b * QK)),
                                     _mm256_loadu_si256((const __m256i *)(qg + b * QK)),
                                     _mm256_loadu_si256((const __m256i *)(kr + b * QK)));
        const __m256 c = _mm256_set1_ps(per_block_ks ? qdg[b] * ksr[b] : qdg[b]);
        f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), c, f);
    }
    return f;
}

/* Scores of query head rows against n int8 key rows k int8[n, hd].
 * q8: s = (sum_b dot_b * qd_b) * (ks[j] * scale)   (ks float[n], one scale per row)
 * q4: s = (sum_b dot_b * (qd_b * ks[j, b])) * scale (ks float[n, nb])
 * Eight rows at a time, their lane sums folded pairwise as they come (hsum8_ps's order), so few
 * vectors are live and none spills. A row's score does not depend on its neighbours: rows past
 * n count as zero vectors, so a key row scores the same in a full group and in a tail. */
ALWAYS_INLINE void scores_int8_nb(const int per_block_ks, const int64_t nb, const int8_t *qq,
                                  const float *qd, int64_t group, int64_t hd, const int8_t *k,
                                  const float *ks, int64_t n, float scale, float *s, int64_t ld)
{
    const int8_t *aq_all = qq + group * hd;
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t g = 0; g < group; g++) {
        const int8_t *qg = qq + g * hd;
        const int8_t *aq = aq_all + g * hd;
        const float *qdg = qd + g * nb;
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
            const int cnt = n - j0 < 8 ? (int)(n - j0) : 8;
#define ROW(jj) ((jj) < cnt ? key_row_dots(per_block_ks, nb, aq, qg, qdg, k + (j0 + (jj)) * hd, \
                                           per_block_ks ? ks + (j0 + (jj)) * nb : NULL) : _mm256_setzero_ps())
            const __m256 p[4] = {_mm256_hadd_ps(ROW(0), ROW(1)), _mm256_hadd_ps(ROW(2), ROW(3)),
                                 _mm256_hadd_ps(ROW(4), ROW(5)), _mm256_hadd_ps(ROW(6), ROW(7))};
#undef ROW
            scores8_store(per_block_ks, hsum8_pairs(p), ks, j0, cnt, vscale, s + g * ld);
        }
    }
}

/* acc[g, d0:d0+32] += sum_j w[g, j] * row_j[d0:d0+32] for gh (1 or 2) heads at once; the
 * `kind` decides how a row's 32 columns become four float vectors. */
ALWAYS_INLINE void load_row32(const int kind, const void *v, int64_t j, int64_t hd, int64_t d0,
                              __m256 f[4])
{
    if (kind == KV_Q8) {
        const int8_t *r = (const int8_t *)v + j * hd + d0;
        for (int i = 0; i < 4; i++)
            f[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(r + 8 * i))));
    } else if (kind == KV_Q4) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint8_t *)v + j * (hd / 2) + d0 / 2));
        const __m128i mask = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, mask), eight);                   /* cols 0..15 */
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), eight); /* 16..31 */
        f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        const float *r = (const float *)v + j * hd + d0;
        for (int i = 0; i < 4; i++)
            f[i] = _mm256_loadu_ps(r + 8 * i);
    }
}

/* w float[group, ld]: per-row weights, already including the row's scale for q8 and f32;
 * for q4 the block scale vs[j, d0/32] is applied here. */
ALWAYS_INLINE void accum_heads(const int kind, const int gh, const void *v, const float *vs,
                               int64_t n, int64_t hd, const float *w0, const float *w1, float *acc0,
                               float *acc1)
{
    const int64_t nb = hd / QK;
    for (int64_t d0 = 0; d0 < hd; d0 += QK) {
        __m256 a[4], b[4];
        for (int i = 0; i < 4; i++) {
            a[i] = _mm256_loadu_ps(acc0 + d0 + 8 * i);
            b[i] = gh == 2 ? _mm256_loadu_ps(acc1 + d0 + 8 * i) : _mm256_setzero_ps();
        }
        for (int64_t j = 0; j < n; j++) {
            __m256 f[4];
            load_row32(kind, v, j, hd, d0, f);
            const float bs = kind == KV_Q4 ? vs[j * nb + d0 / QK] : 1.0f;
            const __m256 p0 = _mm256_set1_ps(kind == KV_Q4 ? w0[j] * bs : w0[j]);
            for (int i = 0; i < 4; i++)
                a[i] = _mm256_fmadd_ps(p0, f[i], a[i]);
            if (gh == 2) {
                const __m256 p1 = _mm256_set1_ps(kind == KV_Q4 ? w1[j] * bs : w1[j]);
                for (int i = 0; i < 4; i++)
                    b[i] = _mm256_fmadd_ps(p1, f[i], b[i]);
            }
        }
        for (int i = 0; i < 4; i++) {
            _mm256_storeu_ps(acc0 + d0 + 8 * i, a[i]);
            if (gh == 2)
                _mm256_storeu_ps(acc1 + d0 + 8 * i, b[i]);
        }
    }
}

/* Row j, columns d0..d0+15 (d0 a multiple of 16) as two float vectors. */
ALWAYS_INLINE void load_row16(const int kind, const void *v, int64_t j, int64_t hd, int64_t d0,
                              __m256 f[2])
{
    if (kind == KV_Q8) {
        const int8_t *r = (const int8_t *)v + j * hd + d0;
        f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)r)));
        f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(r + 8))));
    } else if (kind == KV_Q4) {
        /* columns 0..15 of a block are the low nibbles of its 16 bytes, 16..31 the high ones */
        __m128i raw = _mm_loadu_si128((const __m128i *)((const uint8_t *)v + j * (hd / 2) + (d0 / QK) * (QK / 2)));
        if (d0 % QK)
            raw = _mm_srli_epi16(raw, 4);
        const __m128i x = _mm_sub_epi8(_mm_and_si128(raw, _mm_set1_epi8(0x0f)), _mm_set1_epi8(8));
        f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
        f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)));
    } else {
        const float *r = (const float *)v + j * hd + d0;
        f[0] = _mm256_loadu_ps(r);
        f[1] = _mm256_loadu_ps(r + 8);
    }
}

/* Four rows at once, 16 columns at a time (8 accumulators): every V row is converted to
 * float once for four query rows (a GQA group of 4, or a prefill tile). */
ALWAYS_INLINE void accum_rows4(const int kind, const void *v, const float *vs, int64_t n, int64_t hd,
                               const float *w, int64_t ld, float *acc)
{
    const int64_t nb = hd / QK;
    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
        __m256 a[4][2];
        for (int r = 0; r < 4; r++) {
            a[r][0] = _mm256_loadu_ps(acc + r * hd + d0);
            a[r][1] = _mm256_loadu_ps(acc + r * hd + d0 + 8);
        }
        for (int64_t j = 0; j < n; j++) {
            __m256 f[2];
            load_row16(kind, v, j, hd, d0, f);
            const float bs = kind == KV_Q4 ? vs[j * nb + d0 / QK] : 1.0f;
            for (int r = 0; r < 4; r++) {
                const __m256 pr = _mm256_set1_ps(kind == KV_Q4 ? w[r * ld + j] * bs : w[r * ld + j]);
                a[r][0] = _mm256_fmadd_ps(pr, f[0], a[r][0]);
                a[r][1] = _mm256_fmadd_ps(pr, f[1], a[r][1]);
            }
        }
        for (int r = 0; r < 4; r++) {
            _mm256_storeu_ps(acc + r * hd + d0, a[r][0]);
            _mm256_storeu_ps(acc + r * hd + d0 + 8, a[r][1]);
        }
    }
}

