/*
 * The attention kernels of kernels.h on x86: the AVX2 instantiation of the x86 primitives
 * (attention_x86.h), and the *_simd entry points, which run it or the AVX-512 one
 * (x86/avx512_attention.c) as kernel_attention_variant says.
 */
#include "../internal.h"

#if defined(KERNELS_AVX2)
#define ATTN_NAME(x) x##_avx2
#include "attention_x86.h"
#include <string.h>

extern __typeof__(attention_q8_avx2) attention_q8_avx512;
extern __typeof__(attention_q4_avx2) attention_q4_avx512;
extern __typeof__(attention_f32_avx2) attention_f32_avx512;
extern __typeof__(attention_importance_avx2) attention_importance_avx512;
extern __typeof__(attention_batch_avx2) attention_batch_avx512;
extern __typeof__(attention_probe_avx2) attention_probe_avx512;
extern __typeof__(attention_probe_bound_avx2) attention_probe_bound_avx512;

/* The instantiations, best first, and whether this CPU runs each. */
static const char *const attention_names[] = {"avx512-vnni", "avx2"};
enum { ATTN_AVX512, ATTN_AVX2, ATTN_VARIANTS };

static int attention_cpu_runs(int i)
{
    __builtin_cpu_init();
    return i == ATTN_AVX2 || (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                              __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"));
}

static int attention_active = -1;   /* chosen at the first call: the best this CPU runs */

static int attention_variant_index(void)
{
    int v = __atomic_load_n(&attention_active, __ATOMIC_RELAXED);
    if (v < 0) {
        v = attention_cpu_runs(ATTN_AVX512) ? ATTN_AVX512 : ATTN_AVX2;
        __atomic_store_n(&attention_active, v, __ATOMIC_RELAXED);
    }
    return v;
}

const char *kernel_attention_variant(void)
{
    return attention_names[attention_variant_index()];
}

const char *kernel_attention_variants(void)
{
    static char buf[64];
    buf[0] = '\0';
    for (int i = 0; i < ATTN_VARIANTS; i++) {
        if (!attention_cpu_runs(i))
            continue;
        if (buf[0])
            strcat(buf, " ");
        strcat(buf, attention_names[i]);
    }
    return buf;
}

int kernel_set_attention_variant(const char *name)
{
    for (int i = 0; i < ATTN_VARIANTS; i++) {
        if (strcmp(name, attention_names[i]) == 0 && attention_cpu_runs(i)) {
            __atomic_store_n(&attention_active, i, __ATOMIC_RELAXED);
            return 0;
        }
    }
    return -1;
}

/* fn##_avx512 or fn##_avx2, as the active variant says. */
#define ATTN_CHOSEN(fn) (attention_variant_index() == ATTN_AVX512 ? fn##_avx512 : fn##_avx2)

void attention_q8_simd(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                       const int8_t *k, const float *ks, const int8_t *v, const float *vs,
                       int64_t bs, const int32_t *table, const int32_t *blockpos,
                       const int32_t *count, int64_t nsel, int64_t table_stride,
                       const int32_t *qpos, float scale, float *out, int nthreads)
{
    ATTN_CHOSEN(attention_q8)(q, T, n_kv, group, hd, k, ks, v, vs, bs, table, blockpos, count, nsel,
                              table_stride, qpos, scale, out, nthreads);
}

void attention_q4_simd(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                       const uint8_t *k, const float *ks, const uint8_t *v, const float *vs,
                       int64_t bs, const int32_t *table, const int32_t *blockpos,
                       const int32_t *count, int64_t nsel, int64_t table_stride,
                       const int32_t *qpos, float scale, float *out, int nthreads)
{
    ATTN_CHOSEN(attention_q4)(q, T, n_kv, group, hd, k, ks, v, vs, bs, table, blockpos, count, nsel,
                              table_stride, qpos, scale, out, nthreads);
}

void attention_f32_simd(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                        const float *k, const float *v,
                        int64_t bs, const int32_t *table, const int32_t *blockpos,
                        const int32_t *count, int64_t nsel, int64_t table_stride,
                        const int32_t *qpos, float scale, float *out, int nthreads)
{
    ATTN_CHOSEN(attention_f32)(q, T, n_kv, group, hd, k, v, bs, table, blockpos, count, nsel,
                               table_stride, qpos, scale, out, nthreads);
}

void attention_importance_simd(int kind, const float *q, int64_t T, int64_t n_kv, int64_t group,
                               int64_t hd, const void *k, const float *ks, const void *v,
                               const float *vs, int64_t bs, const int32_t *table,
                               const int32_t *blockpos, const int32_t *count, int64_t nsel,
                               int64_t table_stride, const int32_t *qpos, float scale,
                               float *out, float *importance, int64_t n_positions, int nthreads)
{
    ATTN_CHOSEN(attention_importance)(kind, q, T, n_kv, group, hd, k, ks, v, vs, bs, table, blockpos, count,
                                      nsel, table_stride, qpos, scale, out, importance, n_positions, nthreads);
}

void attention_batch_simd(int kind, const float *q, int64_t nseq, const int64_t *seq_rows,
                          const int64_t *seq_lists, int64_t n_kv, int64_t group, int64_t hd,
                          const void *k, const float *ks, const void *v, const float *vs, int64_t bs,
                          const int32_t *table, const int32_t *blockpos, const int32_t *count,
                          const int32_t *qpos, float scale, float *out, int nthreads)
{
    ATTN_CHOSEN(attention_batch)(kind, q, nseq, seq_rows, seq_lists, n_kv, group, hd, k, ks, v, vs, bs, table,
                                 blockpos, count, qpos, scale, out, nthreads);
}

void attention_probe_simd(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                          int64_t hd, const void *k, const float *ks, int64_t bs, const void *pk,
                          const float *pks, int64_t pbs, const int32_t *table, const int32_t *count,
                          int64_t nblocks, int64_t probe, float scale, float *scores, int nthreads)
{
    ATTN_CHOSEN(attention_probe)(kind, q, R, n_kv, group, hd, k, ks, bs, pk, pks, pbs, table, count, nblocks,
                                 probe, scale, scores, nthreads);
}

void attention_probe_bound_simd(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                                int64_t hd, const void *k, const float *ks, int64_t bs,
                                const int8_t *bk, const float *bks, const int32_t *table,
                                const int32_t *count, int64_t nblocks, int64_t ncand, float scale,
                                float *scores, int nthreads)
{
    ATTN_CHOSEN(attention_probe_bound)(kind, q, R, n_kv, group, hd, k, ks, bs, bk, bks, table, count, nblocks,
                                       ncand, scale, scores, nthreads);
}
#endif /* KERNELS_AVX2 */
