/*
 * The packed route's micro-kernel for x86 (gemm_pack.h), one source for every dot instruction: the
 * including file defines PACKED_TILE (the function's name), PACKED_DOT(acc, w, xb, axb), which
 * adds to each int32 lane of acc the four products of w's bytes (a group of one weight row, packed)
 * and xb's (the same 4 activation bytes in every lane), PACKED_WANTS_ABS (1: the dot also takes axb,
 * their absolute values, from ax) and PACKED_XINIT (1: the lanes start from xinit, 0: from
 * GEMM_FLOAT_MAGIC), then includes this header. 4 activation rows x 8 weight rows (one ymm of int32 lanes per row): no horizontal sum,
 * the block's lanes start from xinit or GEMM_FLOAT_MAGIC and leave as floats by one subtraction.
 * Same float operations per output and block as gemm_tile in avx2.c, so the same bits.
 */

static void PACKED_TILE(const int8_t *pw, int64_t nb, const int8_t *const x[4], const int8_t *const ax[4],
                        const float *xdT, const int32_t *xinit, float *out)
{
    (void)ax;
    (void)xinit;
    const __m256 fm = _mm256_set1_ps(GEMM_FLOAT_MAGIC_F);
    const __m256i magic = _mm256_set1_epi32(GEMM_FLOAT_MAGIC);
    __m256 f[4];
    for (int m = 0; m < 4; m++)
        f[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, pw += GEMM_STRIP_BLOCK_BYTES) {
        __m256i a[4];
        for (int m = 0; m < 4; m++)
            a[m] = PACKED_XINIT ? _mm256_set1_epi32(xinit[b * 4 + m]) : magic;
        for (int g = 0; g < QK / 4; g++) {
            const __m256i w = _mm256_load_si256((const __m256i *)(pw + g * (GEMM_STRIP * 4)));
            for (int m = 0; m < 4; m++) {
                int32_t xv, axv = 0;
                memcpy(&xv, x[m] + b * QK + g * 4, 4);
                if (PACKED_WANTS_ABS)
                    memcpy(&axv, ax[m] + b * QK + g * 4, 4);
                const __m256i xb = _mm256_set1_epi32(xv);
                const __m256i axb = _mm256_set1_epi32(axv);
                (void)axb;
                a[m] = PACKED_DOT(a[m], w, xb, axb);
            }
        }
        const __m256 wd = _mm256_load_ps((const float *)(pw + GEMM_STRIP * QK));
        for (int m = 0; m < 4; m++) {
            const __m256 d = _mm256_sub_ps(_mm256_castsi256_ps(a[m]), fm);
            f[m] = _mm256_fmadd_ps(d, _mm256_mul_ps(wd, _mm256_set1_ps(xdT[b * 4 + m])), f[m]);
        }
    }
    for (int m = 0; m < 4; m++)
        _mm256_storeu_ps(out + m * GEMM_STRIP, f[m]);
}

#undef PACKED_TILE
#undef PACKED_DOT
#undef PACKED_WANTS_ABS
#undef PACKED_XINIT
