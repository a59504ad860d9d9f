/*
 * The V accumulation primitives of the attention template (attention_impl.h) for the SIMD paths,
 * which share their shape: V rows converted to float once for four query rows (accum_rows4),
 * then for two or one (accum_heads). The including path file defines, for kind KV_Q8, KV_Q4 or
 * KV_F32 (w float[rows, ld] the weights of `rows` query rows, acc float[rows, hd]):
 *   accum_rows4(kind, v, vs, n, hd, w, ld, acc)                 rows 0..3 of w and acc;
 *   accum_heads(kind, gh, v, vs, n, hd, w0, w1, acc0, acc1)     gh = 1 or 2 rows;
 *   mul_inplace(x, y, n)                                        x[j] *= y[j];
 * and, to accumulate q8 V its own way, ATTN_ACCUM_Q8_INT and
 *   accum_q8_int(v, n, group, hd, w, ld, acc)                   w: the weights times vs;
 * then includes this header.
 */

ALWAYS_INLINE void accum_all(const int kind, const void *v, const float *vs, int64_t n,
                             int64_t group, int64_t hd, const float *w, int64_t ld, float *acc)
{
    int64_t g = 0;
    for (; g + 4 <= group; g += 4)
        accum_rows4(kind, v, vs, n, hd, w + g * ld, ld, acc + g * hd);
    for (; g + 2 <= group; g += 2)
        accum_heads(kind, 2, v, vs, n, hd, w + g * ld, w + (g + 1) * ld, acc + g * hd, acc + (g + 1) * hd);
    if (g < group)
        accum_heads(kind, 1, v, vs, n, hd, w + g * ld, NULL, acc + g * hd, NULL);
}

ALWAYS_INLINE void attn_accum_q8(const int8_t *v, const float *vs, int64_t n, int64_t group, int64_t hd,
                          float *w, int64_t ld, float *acc)
{
    /* Fold the row scale into the weight once per (head, row), as the portable path does. */
    for (int64_t g = 0; g < group; g++)
        mul_inplace(w + g * ld, vs, n);
#if defined(ATTN_ACCUM_Q8_INT)
    accum_q8_int(v, n, group, hd, w, ld, acc);   /* the path's integer route (NEON) */
#else
    accum_all(KV_Q8, v, NULL, n, group, hd, w, ld, acc);
#endif
}

ALWAYS_INLINE void attn_accum_q4(const uint8_t *v, const float *vs, int64_t n, int64_t group, int64_t hd,
                          float *w, int64_t ld, float *acc)
{
    accum_all(KV_Q4, v, vs, n, group, hd, w, ld, acc);
}

ALWAYS_INLINE void attn_accum_f32(const float *v, int64_t n, int64_t group, int64_t hd,
                           float *w, int64_t ld, float *acc)
{
    accum_all(KV_F32, v, NULL, n, group, hd, w, ld, acc);
}
