/*
 * The kernel contract: every compute kernel here exists twice,
 *   <name>_portable  plain C, always built, the reference;
 *   <name>_simd      the build's best path (NEON+dotprod on aarch64, AVX2 on x86_64),
 *                    which is the portable one where no SIMD path exists.
 * Callers (kernels.pyx, through kernels.pxd) pick one by name; tests compare the two, and
 * appliance/kernels/reference.py holds the numpy twin of each. The KV cache writes and the
 * block choice of sparse attention are plain C only (one version, no _simd): memory-bound or
 * branchy work that SIMD would not speed up.
 *
 * Shapes use row-major C order. Names: N = output features (weight rows),
 * K = input features (multiple of QK = 32), M = activation rows (tokens).
 * Threads: functions that take `nthreads` spread their work over that many threads of the
 * kernels' pool (pool.h; 0 = kernel_default_threads()), chunk by chunk, and their results do not
 * depend on the thread count; none of them touches Python objects, so callers release the GIL.
 */
#ifndef APPLIANCE_KERNELS_H
#define APPLIANCE_KERNELS_H
#include <stdint.h>

#define QK 32  /* quantization block length, along K (weights/activations) or head_dim (KV) */

#ifdef __cplusplus
extern "C" {
#endif

/* The cache format, where one kernel takes any (`kind`); layouts under "attention" below. */
enum kv_kind { KV_Q8 = 0, KV_Q4 = 1, KV_F32 = 2 };

/* ---- fp16 helpers (weight scales are IEEE half, stored as uint16_t) ---- */
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);   /* round to nearest even */

/* ---- activations: int8 per 32-block, max-abs scale -------------------- */
/* x: float[M, K] -> q: int8[M, K], d: float[M, K/QK]; d = max|x_b|/127, q = round(x/d) */
void quantize_rows_q8_portable(const float *x, int64_t M, int64_t K, int8_t *q, float *d);
void quantize_rows_q8_simd(const float *x, int64_t M, int64_t K, int8_t *q, float *d);

/* ---- GEMM / GEMV over quantized weights ------------------------------- */
/* Q8_0: wq int8[N, K], wd fp16[N, K/QK]           (w = wd * wq)
 * Q4_0: wq uint8[N, K/2], wd fp16[N, K/QK]; inside each 32-block of a row, byte j
 *       holds element j in its low nibble and element j+16 in its high nibble;
 *       w = wd * (nibble - 8).
 * xq int8[M, K], xd float[M, K/QK]  (from quantize_rows_q8)
 * y float[M, N]: y[m, n] = sum_b (sum_i xq*wq as int32) * xd[m,b] * wd[n,b]
 * Parallel over N. M == 1 is the GEMV of decode.                              */
void gemm_q8_portable(const int8_t *wq, const uint16_t *wd, int64_t N, int64_t K,
                      const int8_t *xq, const float *xd, int64_t M, float *y, int nthreads);
void gemm_q8_simd(const int8_t *wq, const uint16_t *wd, int64_t N, int64_t K,
                  const int8_t *xq, const float *xd, int64_t M, float *y, int nthreads);
void gemm_q4_portable(const uint8_t *wq, const uint16_t *wd, int64_t N, int64_t K,
                      const int8_t *xq, const float *xd, int64_t M, float *y, int nthreads);
void gemm_q4_simd(const uint8_t *wq, const uint16_t *wd, int64_t N, int64_t K,
                  const int8_t *xq, const float *xd, int64_t M, float *y, int nthreads);

/* ---- GEMM over weights stored in strips (gemm_strips.h) ---------------
 * gemm_strips_bytes: the bytes N rows take packed; gemm_strips_pack: Q8_0 (is_q4 0) or Q4_0 rows,
 * as gemm_q8 / gemm_q4 take them, into ws (64-byte aligned, gemm_strips_bytes long);
 * gemm_strips_{portable,simd}: gemm_q8 / gemm_q4's y from the packed weights, with
 * gemm_q8_simd's bits (portable: the layout's scalar twin);
 * kernel_gemm_strips_fast: 1 when gemm_strips_simd runs a vector micro-kernel on this CPU (the
 * active GEMM variant has one), so that packing pays; 0: it would be the portable loop.       */
int64_t gemm_strips_bytes(int is_q4, int64_t N, int64_t K);
void gemm_strips_pack(int is_q4, const uint8_t *wq, const uint16_t *wd, int64_t N, int64_t K, uint8_t *ws);
void gemm_strips_portable(int is_q4, const uint8_t *ws, int64_t N, int64_t K, const int8_t *xq,
                          const float *xd, int64_t M, float *y, int nthreads);
void gemm_strips_simd(int is_q4, const uint8_t *ws, int64_t N, int64_t K, const int8_t *xq,
                      const float *xd, int64_t M, float *y, int nthreads);
int kernel_gemm_strips_fast(void);

/* ---- elementwise ------------------------------------------------------ */
/* out[m, :] = x[m, :] / sqrt(mean(x[m,:]^2) + eps) * w   (x float[M, D], w float[D]); out may alias x */
void rmsnorm_portable(const float *x, const float *w, int64_t M, int64_t D, float eps, float *out);
void rmsnorm_simd(const float *x, const float *w, int64_t M, int64_t D, float eps, float *out);

/* In-place rotary embedding, rotate-half (GPT-NeoX) convention as Qwen3 uses:
 * x float[M, H, hd]; for token m at position pos[m] and i < hd/2:
 *   a = pos[m] * inv_freq[i]; c = cos(a), s = sin(a)
 *   x0 = x[i], x1 = x[i + hd/2];  x[i] = x0*c - x1*s;  x[i+hd/2] = x1*c + x0*s   */
void rope_portable(float *x, int64_t M, int64_t H, int64_t hd, const int32_t *pos, const float *inv_freq);
void rope_simd(float *x, int64_t M, int64_t H, int64_t hd, const int32_t *pos, const float *inv_freq);

/* out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)); n elements; out may alias gate */
void silu_mul_portable(const float *gate, const float *up, int64_t n, float *out);
void silu_mul_simd(const float *gate, const float *up, int64_t n, float *out);

/* out[m, :] = (x[m, :] - mean) / sqrt(var + eps) * w + b, mean and (biased) variance of the row
 * (x float[M, D], w and b float[D]): the vision tower's LayerNorm; out may alias x */
void layer_norm_portable(const float *x, const float *w, const float *b, int64_t M, int64_t D, float eps,
                         float *out);
void layer_norm_simd(const float *x, const float *w, const float *b, int64_t M, int64_t D, float eps,
                     float *out);

/* out[i] = 0.5 x (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3), computed as x / (1 + exp(-2z))
 * (the same function; GELU's tanh form, the vision tower's); n elements; out may alias x */
void gelu_tanh_portable(const float *x, int64_t n, float *out);
void gelu_tanh_simd(const float *x, int64_t n, float *out);

/* ---- attention over the paged KV cache -------------------------------- */
/* Cache layout for one layer, head-major inside a block (block = `bs` tokens):
 *   q8 : k int8[nblk, n_kv, bs, hd],  ks float[nblk, n_kv, bs]   (per token,head max-abs scale)
 *   q4 : k uint8[nblk, n_kv, bs, hd/2], ks float[nblk, n_kv, bs, hd/QK] (Q4_0 nibble order as above)
 *   f32: k float[nblk, n_kv, bs, hd],  ks unused (NULL)
 *   V has the same layout as K with vs as its scales.
 * Queries: q float[T, Hq, hd] with Hq = n_kv * group; q head j uses kv head j / group.
 * Visible tokens, per kv head h: the blocks table[h*table_stride + i], i < nsel,
 *   each holding count[h*table_stride + i] valid tokens (the first `count` of the block),
 *   in increasing position order; the logical position of a token is passed implicitly:
 *   query t may see a token only if its position <= qpos[t]; positions of listed blocks are
 *   blockpos[h*table_stride + i] * bs + offset (blockpos = logical block index).
 *   table_stride == 0 shares one list across heads (exact attention).
 * One pass: for each (t, h) the group's queries are served by a single scan of the
 * rows, with online softmax (running max, rescale). Scores are scaled by `scale`.
 * q is quantized to int8 per 32-block inside the kernel for the q8/q4 paths.
 * out float[T, Hq, hd]. Parallel over (tile of queries, kv head, part of a long block list).  */
void attention_q8_portable(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                           const int8_t *k, const float *ks, const int8_t *v, const float *vs,
                           int64_t bs, const int32_t *table, const int32_t *blockpos,
                           const int32_t *count, int64_t nsel, int64_t table_stride,
                           const int32_t *qpos, float scale, float *out, int nthreads);
void attention_q8_simd(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                       const int8_t *k, const float *ks, const int8_t *v, const float *vs,
                       int64_t bs, const int32_t *table, const int32_t *blockpos,
                       const int32_t *count, int64_t nsel, int64_t table_stride,
                       const int32_t *qpos, float scale, float *out, int nthreads);
void attention_q4_portable(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                           const uint8_t *k, const float *ks, const uint8_t *v, const float *vs,
                           int64_t bs, const int32_t *table, const int32_t *blockpos,
                           const int32_t *count, int64_t nsel, int64_t table_stride,
                           const int32_t *qpos, float scale, float *out, int nthreads);
void attention_q4_simd(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                       const uint8_t *k, const float *ks, const uint8_t *v, const float *vs,
                       int64_t bs, const int32_t *table, const int32_t *blockpos,
                       const int32_t *count, int64_t nsel, int64_t table_stride,
                       const int32_t *qpos, float scale, float *out, int nthreads);
void attention_f32_portable(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                            const float *k, const float *v,
                            int64_t bs, const int32_t *table, const int32_t *blockpos,
                            const int32_t *count, int64_t nsel, int64_t table_stride,
                            const int32_t *qpos, float scale, float *out, int nthreads);
void attention_f32_simd(const float *q, int64_t T, int64_t n_kv, int64_t group, int64_t hd,
                        const float *k, const float *v,
                        int64_t bs, const int32_t *table, const int32_t *blockpos,
                        const int32_t *count, int64_t nsel, int64_t table_stride,
                        const int32_t *qpos, float scale, float *out, int nthreads);

/* attention_{q8,q4,f32} (kind: enum kv_kind; ks/vs NULL for f32) that also adds, for
 * block-sparse prefill, to importance[p] (p < n_positions; later positions are dropped) the
 * softmax weight each query head of each query gives the listed row at position p, summed over
 * queries and heads. The sums are added in a fixed order: the same on every run and thread
 * count. Working memory grows with (4 * group) * nsel * bs floats per thread.          */
void attention_importance_portable(int kind, const float *q, int64_t T, int64_t n_kv, int64_t group,
                                   int64_t hd, const void *k, const float *ks, const void *v,
                                   const float *vs, int64_t bs, const int32_t *table,
                                   const int32_t *blockpos, const int32_t *count, int64_t nsel,
                                   int64_t table_stride, const int32_t *qpos, float scale,
                                   float *out, float *importance, int64_t n_positions, int nthreads);
void attention_importance_simd(int kind, const float *q, int64_t T, int64_t n_kv, int64_t group,
                               int64_t hd, const void *k, const float *ks, const void *v,
                               const float *vs, int64_t bs, const int32_t *table,
                               const int32_t *blockpos, const int32_t *count, int64_t nsel,
                               int64_t table_stride, const int32_t *qpos, float scale,
                               float *out, float *importance, int64_t n_positions, int nthreads);

/* The attention of several sequences in one call (a decode step's batch), their units spread over
 * the threads together. Sequence s owns query rows seq_rows[s] .. seq_rows[s+1]-1 of q, qpos and out
 * (q float[seq_rows[nseq], n_kv*group, hd]); seq_lists[3s .. 3s+2] = (list0, nsel, stride): kv head
 * h reads the listed blocks list0 + h*stride + i, i < nsel, of table/blockpos/count (stride 0: one
 * list for every head). Each sequence's output is, bit for bit, attention_{q8,q4,f32} (kind: enum
 * kv_kind; ks/vs NULL for f32) of its rows and list alone.                                      */
void attention_batch_portable(int kind, const float *q, int64_t nseq, const int64_t *seq_rows,
                              const int64_t *seq_lists, int64_t n_kv, int64_t group, int64_t hd,
                              const void *k, const float *ks, const void *v, const float *vs, int64_t bs,
                              const int32_t *table, const int32_t *blockpos, const int32_t *count,
                              const int32_t *qpos, float scale, float *out, int nthreads);
void attention_batch_simd(int kind, const float *q, int64_t nseq, const int64_t *seq_rows,
                          const int64_t *seq_lists, int64_t n_kv, int64_t group, int64_t hd,
                          const void *k, const float *ks, const void *v, const float *vs, int64_t bs,
                          const int32_t *table, const int32_t *blockpos, const int32_t *count,
                          const int32_t *qpos, float scale, float *out, int nthreads);

/* Block-sparse probe scores (docs/engine.md, "Block-sparse attention"), the "strided" probe.
 * kind: enum kv_kind; q float[R, n_kv*group, hd]; k, ks one cache layer as attention_*.
 * scores float[n_kv, nblocks]: for kv head h and listed block i (table[i] physical, count[i]
 * valid rows), the max over query rows r < R, over the group's query heads, and over the sampled
 * rows j = 0, step, 2*step, ... < count[i] (step = max(1, count[i] / probe)) of
 * scale * q[r, h*group + g] . K[row j]. For q8/q4 the query is first quantized to int8 per
 * 32-block (as in attention) and K is used without dequantizing.
 * pk/pks (or NULL): a compact copy of the sampled rows of full blocks (count == bs), laid out
 * like a cache layer with pbs rows per (block, kv head) slab, row jj of a slab holding row
 * jj * (bs / probe) of the cache's (PagedKVCache.enable_probe_rows writes it). A full block's
 * sampled rows are then one contiguous run instead of every step-th row of a 4 KB slab, whose
 * striding made the hardware fetch nearly all of K. Same values, so the same scores bit for bit.
 * Needs bs / probe >= 1 and pbs = ceil(bs / (bs / probe)) when pk is given.
 * Parallel over kv heads.                                                                      */
void attention_probe_portable(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                              int64_t hd, const void *k, const float *ks, int64_t bs, const void *pk,
                              const float *pks, int64_t pbs, const int32_t *table, const int32_t *count,
                              int64_t nblocks, int64_t probe, float scale, float *scores, int nthreads);
void attention_probe_simd(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                          int64_t hd, const void *k, const float *ks, int64_t bs, const void *pk,
                          const float *pks, int64_t pbs, const int32_t *table, const int32_t *count,
                          int64_t nblocks, int64_t probe, float scale, float *scores, int nthreads);

/* The bound probe of block-sparse attention (the engine's default; appliance/engine/sparse.py says why).
 * bk int8[nblk, n_kv, 2, hd], bks float[nblk, n_kv, 2]: per full block and kv head, the
 * channel-wise maximum (row 0, rounded up) and minimum (row 1, rounded down) of its K rows,
 * quantized as q8 rows. Per kv head h and listed block i: if count[i] == bs the bound
 * max over query rows of (q+ . max + q- . min) >= every q . K[row] is computed (q+/q- the
 * positive/negative parts of each query row, quantized as q8); the ncand full blocks with the
 * highest bound (ties to the lower index) and every block with count[i] < bs then score
 * scores[h, i] = scale * max over query rows and all count[i] rows of q . K[row] (the exact
 * max-dot, as attention_probe with one row per step); the other blocks score -INFINITY.
 * q float[R, n_kv*group, hd]; kind and k/ks as attention_probe. Parallel over kv heads.   */
void attention_probe_bound_portable(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                                   int64_t hd, const void *k, const float *ks, int64_t bs,
                                   const int8_t *bk, const float *bks, const int32_t *table,
                                   const int32_t *count, int64_t nblocks, int64_t ncand, float scale,
                                   float *scores, int nthreads);
void attention_probe_bound_simd(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group,
                                   int64_t hd, const void *k, const float *ks, int64_t bs,
                                   const int8_t *bk, const float *bks, const int32_t *table,
                                   const int32_t *count, int64_t nblocks, int64_t ncand, float scale,
                                   float *scores, int nthreads);

/* ---- KV cache writes (plain C only) ---------------------------------------
 * x float[T, n_kv, hd]; slot[t] = physical_block * bs + offset of token t; cache layouts as above:
 *   q8 : dst int8[nblk, n_kv, bs, hd],   scale float[nblk, n_kv, bs]
 *        one max-abs scale per (token, kv head) row: d = amax/127, q = rint(x*127/amax)
 *   q4 : dst uint8[nblk, n_kv, bs, hd/2], scale float[nblk, n_kv, bs, hd/QK]   Q4_0 (llama.cpp rule)
 *   f32: dst float[nblk, n_kv, bs, hd]
 * appliance.kernels.quant.quantize_kv_q8/_q4 define them; they agree bit for bit. q8 has a vector
 * path: a 512-token prompt writes 28 layers x 2 x 4096 rows, 7% of its prefill in scalar code. */
void kv_store_q8_portable(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                          int8_t *dst, float *scale);
void kv_store_q8_simd(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                      int8_t *dst, float *scale);
void kv_store_q4(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                 uint8_t *dst, float *scale);
void kv_store_f32(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                  float *dst);

/* ---- block choice of sparse attention (plain C only) ----------------------
 * One decode step's choice (docs/engine.md): chosen uint8[n_kv, nb] from probe scores
 * float[n_kv, nb] and block importance float[nb] (NULL: none). k >= nb: all. Otherwise the
 * (k+1)/2 most important blocks (if any importance is > 0) are kept for every head, the rest of
 * the budget goes to each head's best scores, ties to the lower index, and the last block is
 * always in (replacing the lowest-scoring pick). k < 0 chooses as k = 0.                     */
void sparse_select(const float *scores, int64_t n_kv, int64_t nb, const float *importance, int64_t k,
                   uint8_t *chosen);

/* ---- how many threads the parallel kernels really ran with ------------------
 * The team size of the last parallel job of each family, after its rule for running small work on
 * the calling thread (then 1); 0 before the family first ran. Both paths record it, so a test can
 * see the thread setting reach every kernel.                                                  */
enum kernel_family { KERNEL_GEMM, KERNEL_ATTENTION, KERNEL_PROBE, KERNEL_PROBE_BOUND, KERNEL_FAMILIES };
int kernel_last_threads(int family);

/* ---- the thread pool (pool.h) ------------------------------------------------
 * kernel_default_threads: the team of nthreads == 0 (OMP_NUM_THREADS if set, else the CPUs this
 * process may run on). kernel_pool_stats fills out[KERNEL_POOL_STATS], counters since the process
 * started: jobs run in parallel, chunks run by calling threads, chunks run by workers, times a
 * caller slept for a chunk a worker held (its core was taken), times a worker woke from sleep,
 * chunks a caller took back from a worker that held them without progress (pool_run_out).
 * kernel_pool_hold_workers(1): workers take no chunks (tests: every worker's core taken);
 * kernel_pool_set_spin_us: how long idle workers spin before they sleep (default 200).        */
enum kernel_pool_stat { KERNEL_POOL_JOBS, KERNEL_POOL_CALLER_CHUNKS, KERNEL_POOL_WORKER_CHUNKS,
                        KERNEL_POOL_CALLER_SLEEPS, KERNEL_POOL_WORKER_WAKEUPS, KERNEL_POOL_TAKEN_BACK,
                        KERNEL_POOL_STATS };
int kernel_default_threads(void);
void kernel_pool_stats(int64_t *out);
void kernel_pool_hold_workers(int hold);
void kernel_pool_set_spin_us(int us);
/* The GEMMs of decode-sized products and decode attention (pool.h pool_run_out) return without
 * waiting for a worker that lost its core: the caller computes that worker's chunk again
 * (KERNEL_POOL_TAKEN_BACK counts them), and the worker, when it runs again, finishes a result nobody
 * copies. The operands it reads (weights, activations, the KV cache's arrays) must stay alive
 * until then: kernel_pool_last_stale() is the id of the
 * latest such job of the calling thread (0: none; reading it clears it), kernel_pool_released(id)
 * says whether no worker is inside that job or an earlier one any more.
 * kernel_pool_stall_workers(us): a worker sleeps that long after taking each chunk of such a job,
 * as when it loses its core holding one, alternately before it reads the chunk's state and after
 * (then it computes the chunk late); the caller lets a worker take the first chunk before it
 * starts (tests; 0: off).                                                                       */
/* kernel_pool_late_workers(us): a worker waits that long after it sees each new job before it looks
 * for chunks, and a caller waits twice that long between writing a job's descriptor and opening
 * its chunks, the window in which a worker still holding the last job's number meets the new count
 * (tests; 0: off). */
void kernel_pool_late_workers(int us);
uint64_t kernel_pool_last_stale(void);
int kernel_pool_released(uint64_t job);
void kernel_pool_stall_workers(int us);

/* ---- the GEMM's micro-kernel ---------------------------------------------------
 * Prefill-sized GEMMs (M >= 32) may run a packed route with one of several micro-kernels, chosen
 * at run time from what the CPU has (x86: "avx-vnni", "avx512-vnni" (vpdpbusd), "avx2"; aarch64
 * with dotprod: "sdot"); the vpdpbusd variants also run decode batches (2 <= M < 32) on their own
 * row tiles (gemm_rows.h); "rows" is the row route alone on the path's own tile. Every one gives
 * the same bits.
 * kernel_gemm_variant: the one in use; kernel_gemm_variants: those this build and CPU can run,
 * space-separated ("avx2-vnni-emulated": the vpdpbusd kernels' code with the instruction emulated,
 * for tests); kernel_set_gemm_variant: use another (0), or -1 if it is not one of those.      */
const char *kernel_gemm_variant(void);
const char *kernel_gemm_variants(void);
int kernel_set_gemm_variant(const char *name);

/* ---- the attention kernels' instantiation ----------------------------------------
 * On x86 the attention kernels (attention_*_simd) are built twice, for AVX2 and for AVX-512 with
 * VNNI ("avx2", "avx512-vnni"), the latter run where the CPU has it; both give the same bits.
 * Elsewhere there is one, named as kernel_path. kernel_attention_variant: the one in use;
 * kernel_attention_variants: those this build and CPU run, space-separated;
 * kernel_set_attention_variant: use another (0), or -1 if it is not one of those.             */
const char *kernel_attention_variant(void);
const char *kernel_attention_variants(void);
int kernel_set_attention_variant(const char *name);
/* The bits attention_q8_simd's V pass gives a block's softmax weights: 0 where it multiplies in
 * float (x86: both instantiations; portable), 14 on NEON, which sums them as integers
 * (arm/neon_attention.c). A caller comparing against float attention sizes its tolerance by it. */
int kernel_attention_q8_weight_bits(void);
/* How far attention may lie from float attention of the same dequantized cache, as a fraction of
 * max|V|, when its V pass gives the weights `weight_bits` bits (0: float): 2e-5 for float32
 * scores, exp and sums; with b-bit weights also their rounding, at most 2^-(b+1) of a block's
 * largest weight each, which random data sums to about 2^-b of max|V|: allowed 8 * 2^-b. */
double kernel_attention_tolerance(int weight_bits);

/* ---- what this build is ----------------------------------------------- */
const char *kernel_path(void);        /* "neon-dotprod" | "neon" | "avx2" | "portable" */
int kernel_cpu_supported(void);       /* 1 if this CPU runs the compiled SIMD path (AT_HWCAP / cpuid) */
const char *kernel_cpu_features(void);/* e.g. "asimd asimddp fphp" or "avx2 fma f16c" */

#ifdef __cplusplus
}
#endif
#endif
