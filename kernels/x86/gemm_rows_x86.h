/*
 * The row route's tile run (gemm_rows.h) on an unsigned-by-signed dot, one source for vpdpbusd
 * (x86/avx_vnni.c, x86/avx512_vnni.c) and its AVX2 emulation (x86/avx2.c, for tests). The including
 * file defines ROWS_RUN (the function's name), ROWS_DOT(acc, u, s): acc's int32 lanes plus the
 * four products of u's unsigned and s's signed bytes, exactly, and ROWS_MR (activation rows a
 * transposed strip serves: 4 with 16 vector registers, 8 with AVX-512's 32), and optionally
 * ROWS_DOT512, the same on 512-bit registers (16-row strips); then includes this header, once.
 *
 * Why not gemm_tile's shape: a dot of one weight row's block with one activation row's leaves eight
 * lanes to sum, and those horizontal sums (vphaddd) cost more than the dots. Here each block of
 * eight weight rows is transposed in registers into the packed route's layout (lane c = row c,
 * one vector per four bytes of the block: 24 shuffles, shared by up to ROWS_MR rows), and every
 * activation row then meets it as the packed tile does: four bytes broadcast, one dot per vector,
 * no horizontal sum. The weights go in as w + 128 (unsigned); the 128 * sum(x) that adds is taken
 * out by the lanes' start (xinit), and the float conversion is GEMM_FLOAT_MAGIC's subtraction.
 */

/* 8 rows x 8 four-byte groups -> 8 vectors, vector g lane c = row c's group g. */
static inline __attribute__((always_inline)) void rows_transpose8(__m256i r[8])
{
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) {      /* rows 0-3, then 4-7 */
        u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h + 0], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h + 0], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int g = 0; g < 4; g++) {
        r[g] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x20);
        r[g + 4] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x31);
    }
}

/* One strip of eight weight rows (wrow, wdrow; rows past the range repeat a row in it) against the
 * tile's mr rows: out[m * 8 + c]. Constant (is_q4, mr): unrolled, accumulators in registers. */
static inline __attribute__((always_inline)) void rows_strip(const int is_q4, const int mr,
                                                             const struct gemm_rows_args *a, int64_t t0,
                                                             const uint8_t *const wrow[8],
                                                             const uint16_t *const wdrow[8], int64_t ahead,
                                                             float *out)
{
    const int64_t nb = a->nb, K = a->K;
    /* row t0 + m's block b in xdT and xinit: groups of 4 rows, block-major inside a group */
#define ROWS_OPERAND(m, b) ((((t0) + (m)) / 4) * nb * 4 + (b) * 4 + ((t0) + (m)) % 4)
    const __m256 fm = _mm256_set1_ps(GEMM_FLOAT_MAGIC_F);
    const __m256i offset = _mm256_set1_epi8(is_q4 ? 120 : (char)0x80);   /* q4: nibble - 8 + 128 */
    __m256 f[ROWS_MR];
    for (int m = 0; m < ROWS_MR; m++)
        f[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i w[8];
        for (int c = 0; c < 8; c++) {
            if (ahead)
                _mm_prefetch((const char *)(wrow[c] + ahead + b * (is_q4 ? QK / 2 : QK)), _MM_HINT_T0);
            w[c] = is_q4 ? _mm256_add_epi8(nibbles_q4_32(wrow[c] + b * (QK / 2)), offset)
                         : _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wrow[c] + b * QK)), offset);
        }
        rows_transpose8(w);
        const __m256 wd = _mm256_cvtph_ps(_mm_setr_epi16(
            (short)wdrow[0][b], (short)wdrow[1][b], (short)wdrow[2][b], (short)wdrow[3][b],
            (short)wdrow[4][b], (short)wdrow[5][b], (short)wdrow[6][b], (short)wdrow[7][b]));
        for (int m = 0; m < mr; m++) {
            const int8_t *xb = a->x + (t0 + m) * K + b * QK;
            __m256i acc = _mm256_set1_epi32(a->xinit[ROWS_OPERAND(m, b)]);
            for (int g = 0; g < QK / 4; g++) {
                int32_t xv;
                memcpy(&xv, xb + g * 4, 4);
                acc = ROWS_DOT(acc, w[g], _mm256_set1_epi32(xv));
            }
            const __m256 d = _mm256_sub_ps(_mm256_castsi256_ps(acc), fm);
            f[m] = _mm256_fmadd_ps(d, _mm256_mul_ps(wd, _mm256_set1_ps(a->xdT[ROWS_OPERAND(m, b)])), f[m]);
        }
    }
#undef ROWS_OPERAND
    for (int m = 0; m < mr; m++)
        _mm256_storeu_ps(out + m * 8, f[m]);
}

#if defined(ROWS_DOT512)
/* rows_strip on 512-bit registers: sixteen weight rows a strip (out[m * 16 + c]). Register r[c]
 * holds row c's block in its low half and row 8 + c's in its high half, so the 8-row transpose's
 * in-lane unpacks serve both halves at once; its last step (one 128-bit lane shuffle per vector)
 * leaves lane order rows 0-3, 8-11, 4-7, 12-15, which the scales take on and the sums put back
 * once a strip. Half the shuffles, broadcasts and dots of two 8-row strips per multiply-add (on
 * an AVX-512 EPYC: 1.4-1.6x the 8-row strips' rate at M = 8, docs/performance.md). */
static inline __attribute__((always_inline)) void rows_strip16(const int is_q4, const int mr,
                                                               const struct gemm_rows_args *a, int64_t t0,
                                                               const uint8_t *const wrow[16],
                                                               const uint16_t *const wdrow[16], int64_t ahead,
                                                               float *out)
{
    const int64_t nb = a->nb, K = a->K;
#define ROWS_OPERAND(m, b) ((((t0) + (m)) / 4) * nb * 4 + (b) * 4 + ((t0) + (m)) % 4)
    const __m512 fm = _mm512_set1_ps(GEMM_FLOAT_MAGIC_F);
    const __m256i offset = _mm256_set1_epi8(is_q4 ? 120 : (char)0x80);
    const int lane_row[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    __m512 f[ROWS_MR];
    for (int m = 0; m < ROWS_MR; m++)
        f[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i r[8], t[8], u[8];
        for (int c = 0; c < 8; c++) {
            if (ahead) {
                _mm_prefetch((const char *)(wrow[c] + ahead + b * (is_q4 ? QK / 2 : QK)), _MM_HINT_T0);
                _mm_prefetch((const char *)(wrow[c + 8] + ahead + b * (is_q4 ? QK / 2 : QK)), _MM_HINT_T0);
            }
            const __m256i lo = is_q4 ? _mm256_add_epi8(nibbles_q4_32(wrow[c] + b * (QK / 2)), offset)
                                     : _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wrow[c] + b * QK)), offset);
            const __m256i hi = is_q4 ? _mm256_add_epi8(nibbles_q4_32(wrow[c + 8] + b * (QK / 2)), offset)
                                     : _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wrow[c + 8] + b * QK)),
                                                        offset);
            r[c] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
        for (int i = 0; i < 4; i++) {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        for (int h = 0; h < 2; h++) {
            u[4 * h + 0] = _mm512_unpacklo_epi64(t[4 * h + 0], t[4 * h + 2]);
            u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h + 0], t[4 * h + 2]);
            u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
            u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
        }
        /* 128-bit lanes: u[g] = (rows 0-3 | groups g, g+4 | rows 8-11 | ...), u[4+g] rows 4-7, 12-15 */
        for (int g = 0; g < 4; g++) {
            r[g] = _mm512_shuffle_i64x2(u[g], u[4 + g], 0x88);       /* lanes 0, 2 of each: group g */
            r[g + 4] = _mm512_shuffle_i64x2(u[g], u[4 + g], 0xDD);   /* lanes 1, 3: group g + 4 */
        }
        uint16_t h16[16];
        for (int l = 0; l < 16; l++)
            h16[l] = wdrow[lane_row[l]][b];
        const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h16));
        for (int m = 0; m < mr; m++) {
            const int8_t *xb = a->x + (t0 + m) * K + b * QK;
            __m512i acc = _mm512_set1_epi32(a->xinit[ROWS_OPERAND(m, b)]);
            for (int g = 0; g < QK / 4; g++) {
                int32_t xv;
                memcpy(&xv, xb + g * 4, 4);
                acc = ROWS_DOT512(acc, r[g], _mm512_set1_epi32(xv));
            }
            const __m512 d = _mm512_sub_ps(_mm512_castsi512_ps(acc), fm);
            f[m] = _mm512_fmadd_ps(d, _mm512_mul_ps(wd, _mm512_set1_ps(a->xdT[ROWS_OPERAND(m, b)])), f[m]);
        }
    }
#undef ROWS_OPERAND
    for (int m = 0; m < mr; m++)       /* lanes back in row order: swap the middle 128-bit lanes */
        _mm512_storeu_ps(out + m * 16, _mm512_shuffle_f32x4(f[m], f[m], 0xD8));
}
#endif

/* Rows t0 .. t0+mr-1 (mr <= ROWS_MR) against every strip of the run. */
static inline __attribute__((always_inline)) void rows_run_tile(const struct gemm_rows_args *a, const int is_q4,
                                                                const int mr, int64_t t0)
{
    const int64_t nb = a->nb, row_bytes = a->row_bytes;
    const int64_t n_begin = a->g0 * 4, n_end = a->g1 * 4 < a->N ? a->g1 * 4 : a->N;
    int64_t n0 = n_begin;
#if defined(ROWS_DOT512)
    float out16[ROWS_MR * 16];
    for (; n_end - n0 > 8; n0 += 16) {      /* 16-row strips while more than 8 rows remain */
        const int ncols = n_end - n0 < 16 ? (int)(n_end - n0) : 16;
        const uint8_t *wrow[16];
        const uint16_t *wdrow[16];
        for (int c = 0; c < 16; c++) {
            const int64_t n = c < ncols ? n0 + c : n_end - 1;
            wrow[c] = a->wq + n * row_bytes;
            wdrow[c] = a->wd + n * nb;
        }
        const int64_t ahead = a->prefetch && t0 == 0 && n0 + 16 < n_end ? 16 * row_bytes : 0;
        rows_strip16(is_q4, mr, a, t0, wrow, wdrow, ahead, out16);
        for (int m = 0; m < mr; m++)
            memcpy(a->y + (t0 + m) * a->ldy + n0, out16 + m * 16, (size_t)ncols * sizeof(float));
    }
#endif
    float out[ROWS_MR * 8];
    for (; n0 < n_end; n0 += 8) {
        const int ncols = n_end - n0 < 8 ? (int)(n_end - n0) : 8;
        const uint8_t *wrow[8];
        const uint16_t *wdrow[8];
        for (int c = 0; c < 8; c++) {
            /* Past the range, repeat its last row: computed and thrown away, never out of bounds. */
            const int64_t n = c < ncols ? n0 + c : n_end - 1;
            wrow[c] = a->wq + n * row_bytes;
            wdrow[c] = a->wd + n * nb;
        }
        const int64_t ahead = a->prefetch && t0 == 0 && n0 + 8 < n_end ? 8 * row_bytes : 0;
        rows_strip(is_q4, mr, a, t0, wrow, wdrow, ahead, out);
        for (int m = 0; m < mr; m++)
            memcpy(a->y + (t0 + m) * a->ldy + n0, out + m * 8, (size_t)ncols * sizeof(float));
    }
}

static void ROWS_RUN(const struct gemm_rows_args *a)
{
    for (int64_t t0 = 0; t0 < a->mr; t0 += ROWS_MR) {
        const int mr = a->mr - t0 < ROWS_MR ? (int)(a->mr - t0) : ROWS_MR;
        /* constant (is_q4, mr) per call: unrolled, accumulators in registers */
        switch (mr) {
#define ROWS_CASE(MR_) case MR_: \
            if (a->is_q4) rows_run_tile(a, 1, MR_, t0); else rows_run_tile(a, 0, MR_, t0); break;
        ROWS_CASE(1)
        ROWS_CASE(2)
        ROWS_CASE(3)
#if ROWS_MR >= 8
        ROWS_CASE(5)
        ROWS_CASE(6)
        ROWS_CASE(7)
        ROWS_CASE(8)
#endif
        default: ROWS_CASE(4)
#undef ROWS_CASE
        }
    }
}

#undef ROWS_RUN
#undef ROWS_DOT
#undef ROWS_DOT512
#undef ROWS_MR
