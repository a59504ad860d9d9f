/*
 * What this build is, and whether this CPU can run it.
 * Where no SIMD path is compiled, every *_simd is its *_portable twin (the one place that says so).
 */
#include <math.h>
#include "internal.h"

#if defined(__aarch64__) && defined(__linux__)
#  include <sys/auxv.h>
#  include <asm/hwcap.h>
#endif

#if !defined(KERNELS_HAVE_SIMD)

void quantize_rows_q8_simd(const float *x, int64_t M, int64_t K, int8_t *q, float *d)
{
    quantize_rows_q8_portable(x, M, K, q, d);
}

void kv_store_q8_simd(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                      int8_t *dst, float *scale)
{
    kv_store_q8_portable(x, T, n_kv, hd, slot, bs, dst, scale);
}

void gemm_q8_simd(const int8_t *wq, const uint16_t *wd, int64_t N, int64_t K,
                  const int8_t *xq, const float *xd, int64_t M, float *y, int nthreads)
{
    gemm_q8_portable(wq, wd, N, K, xq, xd, M, y, nthreads);
}

void gemm_q4_simd(const uint8_t *wq, const uint16_t *wd, int64_t N, int64_t K,
                  const int8_t *xq, const float *xd, int64_t M, float *y, int nthreads)
{
    gemm_q4_portable(wq, wd, N, K, xq, xd, M, y, nthreads);
}

void gemm_strips_simd(int is_q4, const uint8_t *ws, int64_t N, int64_t K, const int8_t *xq,
                      const float *xd, int64_t M, float *y, int nthreads)
{
    gemm_strips_portable(is_q4, ws, N, K, xq, xd, M, y, nthreads);
}

void rmsnorm_simd(const float *x, const float *w, int64_t M, int64_t D, float eps, float *out)
{
    rmsnorm_portable(x, w, M, D, eps, out);
}

void rope_simd(float *x, int64_t M, int64_t H, int64_t hd, const int32_t *pos, const float *inv_freq)
{
    rope_portable(x, M, H, hd, pos, inv_freq);
}

void silu_mul_simd(const float *gate, const float *up, int64_t n, float *out)
{
    silu_mul_portable(gate, up, n, out);
}

void layer_norm_simd(const float *x, const float *w, const float *b, int64_t M, int64_t D, float eps,
                     float *out)
{
    layer_norm_portable(x, w, b, M, D, eps, out);
}

void gelu_tanh_simd(const float *x, int64_t n, float *out)
{
    gelu_tanh_portable(x, n, out);
}

void attention_q8_simd(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                       const int8_t *k, const float *ks, const int8_t *v, const float *vs,
                       int64_t bs, const int32_t *table, const int32_t *blockpos,
                       const int32_t *count, int64_t nsel, int64_t table_stride,
                       const int32_t *qpos, float scale, float *out, int nthreads)
{
    attention_q8_portable(q, T, n_kv, group, hd, k, ks, v, vs, bs, table, blockpos, count, nsel,
                          table_stride, qpos, scale, out, nthreads);
}

void attention_q4_simd(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                       const uint8_t *k, const float *ks, const uint8_t *v, const float *vs,
                       int64_t bs, const int32_t *table, const int32_t *blockpos,
                       const int32_t *count, int64_t nsel, int64_t table_stride,
                       const int32_t *qpos, float scale, float *out, int nthreads)
{
    attention_q4_portable(q, T, n_kv, group, hd, k, ks, v, vs, bs, table, blockpos, count, nsel,
                          table_stride, qpos, scale, out, nthreads);
}

void attention_f32_simd(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                        const float *k, const float *v,
                        int64_t bs, const int32_t *table, const int32_t *blockpos,
                        const int32_t *count, int64_t nsel, int64_t table_stride,
                        const int32_t *qpos, float scale, float *out, int nthreads)
{
    attention_f32_portable(q, T, n_kv, group, hd, k, v, bs, table, blockpos, count, nsel,
                           table_stride, qpos, scale, out, nthreads);
}

void attention_importance_simd(int kind, const float *q, int64_t T, int64_t n_kv, int64_t group,
                               int64_t hd, const void *k, const float *ks, const void *v,
                               const float *vs, int64_t bs, const int32_t *table,
                               const int32_t *blockpos, const int32_t *count, int64_t nsel,
                               int64_t table_stride, const int32_t *qpos, float scale,
                               float *out, float *importance, int64_t n_positions, int nthreads)
{
    attention_importance_portable(kind, q, T, n_kv, group, hd, k, ks, v, vs, bs, table, blockpos, count,
                                  nsel, table_stride, qpos, scale, out, importance, n_positions,
                                  nthreads);
}

void attention_batch_simd(int kind, const float *q, int64_t nseq, const int64_t *seq_rows,
                          const int64_t *seq_lists, int64_t n_kv, int64_t group, int64_t hd,
                          const void *k, const float *ks, const void *v, const float *vs, int64_t bs,
                          const int32_t *table, const int32_t *blockpos, const int32_t *count,
                          const int32_t *qpos, float scale, float *out, int nthreads)
{
    attention_batch_portable(kind, q, nseq, seq_rows, seq_lists, n_kv, group, hd, k, ks, v, vs, bs, table,
                             blockpos, count, qpos, scale, out, nthreads);
}

void attention_probe_simd(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                          int64_t hd, const void *k, const float *ks, int64_t bs, const void *pk,
                          const float *pks, int64_t pbs, const int32_t *table, const int32_t *count,
                          int64_t nblocks, int64_t probe, float scale, float *scores, int nthreads)
{
    attention_probe_portable(kind, q, R, n_kv, group, hd, k, ks, bs, pk, pks, pbs, table, count, nblocks,
                             probe, scale, scores, nthreads);
}

void attention_probe_bound_simd(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                                   int64_t hd, const void *k, const float *ks, int64_t bs,
                                   const int8_t *bk, const float *bks, const int32_t *table,
                                   const int32_t *count, int64_t nblocks, int64_t ncand, float scale,
                                   float *scores, int nthreads)
{
    attention_probe_bound_portable(kind, q, R, n_kv, group, hd, k, ks, bs, bk, bks, table, count, nblocks,
                                   ncand, scale, scores, nthreads);
}

#endif /* !KERNELS_HAVE_SIMD */

#if !defined(KERNELS_AVX2) && !defined(KERNELS_NEON_DOTPROD)
/* No packed GEMM route in this build: the row route is all there is. */
const char *kernel_gemm_variant(void)
{
    return "rows";
}

const char *kernel_gemm_variants(void)
{
    return "rows";
}

int kernel_set_gemm_variant(const char *name)
{
    return strcmp(name, "rows") == 0 ? 0 : -1;
}
#endif

#if !defined(KERNELS_AVX2)
/* One attention instantiation in this build (x86/avx2_attention.c chooses among two). */
const char *kernel_attention_variant(void)
{
    return kernel_path();
}

const char *kernel_attention_variants(void)
{
    return kernel_path();
}

int kernel_set_attention_variant(const char *name)
{
    return strcmp(name, kernel_path()) == 0 ? 0 : -1;
}

#include "gemm_strips.h"
/* Only x86 has strips micro-kernels (x86/avx2.c chooses); elsewhere weights stay in rows. */
gemm_strips_fn gemm_strips_runner(void)
{
    return NULL;
}
#endif

int kernels_threads_ran[KERNEL_FAMILIES];

int kernel_last_threads(int family)
{
    if (family < 0 || family >= KERNEL_FAMILIES)
        return -1;
    return __atomic_load_n(&kernels_threads_ran[family], __ATOMIC_RELAXED);
}

int kernel_attention_q8_weight_bits(void)
{
#if defined(KERNELS_NEON)
    return 14;
#else
    return 0;
#endif
}

double kernel_attention_tolerance(int weight_bits)
{
    return 2e-5 + (weight_bits > 0 ? 8.0 * ldexp(1.0, -weight_bits) : 0.0);
}

const char *kernel_path(void)
{
#if defined(KERNELS_AVX2)
    return "avx2";
#elif defined(KERNELS_NEON_DOTPROD)
    return "neon-dotprod";
#elif defined(KERNELS_NEON)
    return "neon";
#else
    return "portable";
#endif
}

int kernel_cpu_supported(void)
{
#if defined(KERNELS_AVX2)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#elif defined(KERNELS_NEON) && defined(__linux__)
    /* /proc/cpuinfo lies under qemu-user (it shows the host); the auxiliary vector does not. */
    const unsigned long hw = getauxval(AT_HWCAP);
#  if defined(KERNELS_NEON_DOTPROD)
    return (hw & HWCAP_ASIMD) && (hw & HWCAP_ASIMDDP);
#  else
    return (hw & HWCAP_ASIMD) != 0;
#  endif
#else
    return 1;   /* portable C (or a NEON build off Linux, where we cannot ask): runs anywhere it built */
#endif
}

static void append_word(char *buf, size_t cap, const char *word)
{
    if (strlen(buf) + strlen(word) + 2 > cap)
        return;
    if (buf[0])
        strcat(buf, " ");
    strcat(buf, word);
}

const char *kernel_cpu_features(void)
{
    static char buf[160];
    buf[0] = '\0';
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    /* __builtin_cpu_supports takes only string literals, hence the macro. */
#  define FEATURE(name) if (__builtin_cpu_supports(name)) append_word(buf, sizeof buf, name)
    FEATURE("sse4.2");
    FEATURE("avx");
    FEATURE("avx2");
    FEATURE("fma");
    FEATURE("f16c");
    FEATURE("avx512f");
    FEATURE("avx512bw");
    FEATURE("avx512vl");
    FEATURE("avx512vnni");
#  if defined(__GNUC__) && __GNUC__ >= 11
    FEATURE("avxvnni");
#  endif
#  undef FEATURE
#elif defined(__aarch64__) && defined(__linux__)
    const unsigned long hw = getauxval(AT_HWCAP);
    if (hw & HWCAP_ASIMD) append_word(buf, sizeof buf, "asimd");
    if (hw & HWCAP_ASIMDDP) append_word(buf, sizeof buf, "asimddp");
    if (hw & HWCAP_FPHP) append_word(buf, sizeof buf, "fphp");
    if (hw & HWCAP_ASIMDHP) append_word(buf, sizeof buf, "asimdhp");
#  ifdef HWCAP_SVE
    if (hw & HWCAP_SVE) append_word(buf, sizeof buf, "sve");
#  endif
#endif
    return buf;
}
