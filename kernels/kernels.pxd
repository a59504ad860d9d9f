# The kernel contract (kernels/kernels.h), declared once for Cython: the only extern block of
# the kernels' Cython (tests/kernels/test_kernel_contract.py holds it to the header). Everything
# is nogil: no kernel touches a Python object. Axis names follow the header: N out features,
# K in features, M rows, T queries, hd head_dim.
from libc.stdint cimport int8_t, uint8_t, uint16_t, int32_t, int64_t, uint64_t

cdef extern from "kernels.h" nogil:
    enum: QK

    enum kv_kind:
        KV_Q8
        KV_Q4
        KV_F32

    # C names that the module's own Python functions reuse get a c_ prefix here.
    float c_fp16_to_fp32 "fp16_to_fp32"(uint16_t h)
    uint16_t c_fp32_to_fp16 "fp32_to_fp16"(float f)

    void quantize_rows_q8_portable(const float *x__mk, int64_t M, int64_t K, int8_t *q__mk, float *d__mb)
    void quantize_rows_q8_simd(const float *x__mk, int64_t M, int64_t K, int8_t *q__mk, float *d__mb)

    void gemm_q8_portable(const int8_t *wq__nk, const uint16_t *wd__nb, int64_t N, int64_t K,
                          const int8_t *xq__mk, const float *xd__mb, int64_t M, float *y__mn, int nthreads)
    void gemm_q8_simd(const int8_t *wq__nk, const uint16_t *wd__nb, int64_t N, int64_t K,
                      const int8_t *xq__mk, const float *xd__mb, int64_t M, float *y__mn, int nthreads)
    void gemm_q4_portable(const uint8_t *wq__nk2, const uint16_t *wd__nb, int64_t N, int64_t K,
                          const int8_t *xq__mk, const float *xd__mb, int64_t M, float *y__mn, int nthreads)
    void gemm_q4_simd(const uint8_t *wq__nk2, const uint16_t *wd__nb, int64_t N, int64_t K,
                      const int8_t *xq__mk, const float *xd__mb, int64_t M, float *y__mn, int nthreads)

    int64_t gemm_strips_bytes(int is_q4, int64_t N, int64_t K)
    void gemm_strips_pack(int is_q4, const uint8_t *wq, const uint16_t *wd, int64_t N, int64_t K, uint8_t *ws)
    void gemm_strips_portable(int is_q4, const uint8_t *ws, int64_t N, int64_t K, const int8_t *xq__mk,
                              const float *xd__mb, int64_t M, float *y__mn, int nthreads)
    void gemm_strips_simd(int is_q4, const uint8_t *ws, int64_t N, int64_t K, const int8_t *xq__mk,
                          const float *xd__mb, int64_t M, float *y__mn, int nthreads)
    int kernel_gemm_strips_fast()

    void rmsnorm_portable(const float *x__md, const float *w__d, int64_t M, int64_t D, float eps, float *out__md)
    void rmsnorm_simd(const float *x__md, const float *w__d, int64_t M, int64_t D, float eps, float *out__md)
    void rope_portable(float *x__mhd, int64_t M, int64_t H, int64_t hd, const int32_t *pos__m, const float *inv_freq__h)
    void rope_simd(float *x__mhd, int64_t M, int64_t H, int64_t hd, const int32_t *pos__m, const float *inv_freq__h)
    void silu_mul_portable(const float *gate, const float *up, int64_t n, float *out)
    void silu_mul_simd(const float *gate, const float *up, int64_t n, float *out)
    void layer_norm_portable(const float *x, const float *w, const float *b, int64_t M, int64_t D, float eps,
                             float *out)
    void layer_norm_simd(const float *x, const float *w, const float *b, int64_t M, int64_t D, float eps,
                         float *out)
    void gelu_tanh_portable(const float *x, int64_t n, float *out)
    void gelu_tanh_simd(const float *x, int64_t n, float *out)

    void attention_q8_portable(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                               const int8_t *k, const float *ks, const int8_t *v, const float *vs,
                               int64_t bs, const int32_t *table, const int32_t *blockpos,
                               const int32_t *count, int64_t nsel, int64_t table_stride,
                               const int32_t *qpos, float scale, float *out, int nthreads)
    void attention_q8_simd(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                           const int8_t *k, const float *ks, const int8_t *v, const float *vs,
                           int64_t bs, const int32_t *table, const int32_t *blockpos,
                           const int32_t *count, int64_t nsel, int64_t table_stride,
                           const int32_t *qpos, float scale, float *out, int nthreads)
    void attention_q4_portable(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                               const uint8_t *k, const float *ks, const uint8_t *v, const float *vs,
                               int64_t bs, const int32_t *table, const int32_t *blockpos,
                               const int32_t *count, int64_t nsel, int64_t table_stride,
                               const int32_t *qpos, float scale, float *out, int nthreads)
    void attention_q4_simd(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                           const uint8_t *k, const float *ks, const uint8_t *v, const float *vs,
                           int64_t bs, const int32_t *table, const int32_t *blockpos,
                           const int32_t *count, int64_t nsel, int64_t table_stride,
                           const int32_t *qpos, float scale, float *out, int nthreads)
    void attention_f32_portable(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                                const float *k, const float *v,
                                int64_t bs, const int32_t *table, const int32_t *blockpos,
                                const int32_t *count, int64_t nsel, int64_t table_stride,
                                const int32_t *qpos, float scale, float *out, int nthreads)
    void attention_f32_simd(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                            const float *k, const float *v,
                            int64_t bs, const int32_t *table, const int32_t *blockpos,
                            const int32_t *count, int64_t nsel, int64_t table_stride,
                            const int32_t *qpos, float scale, float *out, int nthreads)

    void attention_importance_portable(int kind, const float *q, int64_t T, int64_t n_kv, int64_t group,
                                       int64_t hd, const void *k, const float *ks, const void *v,
                                       const float *vs, int64_t bs, const int32_t *table,
                                       const int32_t *blockpos, const int32_t *count, int64_t nsel,
                                       int64_t table_stride, const int32_t *qpos, float scale,
                                       float *out, float *importance, int64_t n_positions, int nthreads)
    void attention_importance_simd(int kind, const float *q, int64_t T, int64_t n_kv, int64_t group,
                                   int64_t hd, const void *k, const float *ks, const void *v,
                                   const float *vs, int64_t bs, const int32_t *table,
                                   const int32_t *blockpos, const int32_t *count, int64_t nsel,
                                   int64_t table_stride, const int32_t *qpos, float scale,
                                   float *out, float *importance, int64_t n_positions, int nthreads)

    void attention_batch_portable(int kind, const float *q, int64_t nseq, const int64_t *seq_rows,
                                  const int64_t *seq_lists, int64_t n_kv, int64_t group, int64_t hd,
                                  const void *k, const float *ks, const void *v, const float *vs, int64_t bs,
                                  const int32_t *table, const int32_t *blockpos, const int32_t *count,
                                  const int32_t *qpos, float scale, float *out, int nthreads)
    void attention_batch_simd(int kind, const float *q, int64_t nseq, const int64_t *seq_rows,
                              const int64_t *seq_lists, int64_t n_kv, int64_t group, int64_t hd,
                              const void *k, const float *ks, const void *v, const float *vs, int64_t bs,
                              const int32_t *table, const int32_t *blockpos, const int32_t *count,
                              const int32_t *qpos, float scale, float *out, int nthreads)

    void attention_probe_portable(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                                  int64_t hd, const void *k, const float *ks, int64_t bs, const void *pk,
                                  const float *pks, int64_t pbs, const int32_t *table, const int32_t *count,
                                  int64_t nblocks, int64_t probe, float scale, float *scores, int nthreads)
    void attention_probe_simd(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                              int64_t hd, const void *k, const float *ks, int64_t bs, const void *pk,
                              const float *pks, int64_t pbs, const int32_t *table, const int32_t *count,
                              int64_t nblocks, int64_t probe, float scale, float *scores, int nthreads)

    void attention_probe_bound_portable(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                                   int64_t hd, const void *k, const float *ks, int64_t bs,
                                   const int8_t *bk, const float *bks, const int32_t *table,
                                   const int32_t *count, int64_t nblocks, int64_t ncand, float scale,
                                   float *scores, int nthreads)
    void attention_probe_bound_simd(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                                   int64_t hd, const void *k, const float *ks, int64_t bs,
                                   const int8_t *bk, const float *bks, const int32_t *table,
                                   const int32_t *count, int64_t nblocks, int64_t ncand, float scale,
                                   float *scores, int nthreads)

    void kv_store_q8_portable(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                              int8_t *dst, float *scale)
    void kv_store_q8_simd(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                          int8_t *dst, float *scale)
    void kv_store_q4(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                     uint8_t *dst, float *scale)
    void kv_store_f32(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                      float *dst)

    void sparse_select(const float *scores, int64_t n_kv, int64_t nb, const float *importance, int64_t k,
                       uint8_t *chosen)

    enum kernel_family:
        KERNEL_GEMM
        KERNEL_ATTENTION
        KERNEL_PROBE
        KERNEL_PROBE_BOUND
        KERNEL_FAMILIES
    int kernel_last_threads(int family)

    enum kernel_pool_stat:
        KERNEL_POOL_JOBS
        KERNEL_POOL_CALLER_CHUNKS
        KERNEL_POOL_WORKER_CHUNKS
        KERNEL_POOL_CALLER_SLEEPS
        KERNEL_POOL_WORKER_WAKEUPS
        KERNEL_POOL_TAKEN_BACK
        KERNEL_POOL_STATS
    int kernel_default_threads()
    void kernel_pool_stats(int64_t *out)
    void kernel_pool_hold_workers(int hold)
    void kernel_pool_set_spin_us(int us)
    uint64_t kernel_pool_last_stale()
    int kernel_pool_released(uint64_t job)
    void kernel_pool_stall_workers(int us)
    void kernel_pool_late_workers(int us)

    const char *kernel_gemm_variant()
    const char *kernel_gemm_variants()
    int kernel_set_gemm_variant(const char *name)

    const char *kernel_attention_variant()
    const char *kernel_attention_variants()
    int kernel_set_attention_variant(const char *name)
    int kernel_attention_q8_weight_bits()
    double kernel_attention_tolerance(int weight_bits)

    const char *c_kernel_path "kernel_path"()
    int kernel_cpu_supported()
    const char *kernel_cpu_features()
