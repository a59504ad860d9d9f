/* Probe scores and block choice for block-sparse attention; see sparse_attention.h. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "sparse_attention.h"
#include "topk.h"

#define QK 32

/* q float[hd] -> int8[hd] + float[hd/QK]: max-abs per block, round half to even (= quantize_rows_q8). */
static void quantize_q(const float *x, int64_t hd, int8_t *q, float *d)
{
    for (int64_t b = 0; b < hd / QK; b++) {
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) {
            const float a = fabsf(x[b * QK + i]);
            amax = a > amax ? a : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < QK; i++)
            q[b * QK + i] = (int8_t)nearbyintf(x[b * QK + i] * inv);
        d[b] = amax / 127.0f;
    }
}

/* One score: query (quantized qq/qd or float qf) against K row `row` of the slab. */
static inline float row_dot(int kind, const int8_t *qq, const float *qd, const float *qf,
                            const void *k, const float *ks, int64_t row, int64_t hd)
{
    const int64_t nb = hd / QK;
    float s = 0.0f;
    if (kind == SPARSE_KV_Q8) {
        const int8_t *kr = (const int8_t *)k + row * hd;
        for (int64_t b = 0; b < nb; b++) {
            int32_t acc = 0;
            for (int i = 0; i < QK; i++)
                acc += (int32_t)qq[b * QK + i] * (int32_t)kr[b * QK + i];
            s += (float)acc * qd[b];
        }
        return s * ks[row];
    }
    if (kind == SPARSE_KV_Q4) {
        const uint8_t *kr = (const uint8_t *)k + row * hd / 2;
        const float *kd = ks + row * nb;
        for (int64_t b = 0; b < nb; b++) {
            int32_t acc = 0;
            for (int i = 0; i < QK / 2; i++) {
                const uint8_t byte = kr[b * QK / 2 + i];
                acc += (int32_t)qq[b * QK + i] * ((int32_t)(byte & 0x0f) - 8);
                acc += (int32_t)qq[b * QK + i + QK / 2] * ((int32_t)(byte >> 4) - 8);
            }
            s += (float)acc * qd[b] * kd[b];
        }
        return s;
    }
    const float *kr = (const float *)k + row * hd;
    for (int64_t i = 0; i < hd; i++)
        s += qf[i] * kr[i];
    return s;
}

/* First row of the (physical block, kv head) slab. */
static inline int64_t slab_row(int32_t block, int64_t h, int64_t n_kv, int64_t bs)
{
    return ((int64_t)block * n_kv + h) * bs;
}

void sparse_probe(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group, int64_t hd,
                  const void *k, const float *ks, int64_t bs, const int32_t *table,
                  const int32_t *count, int64_t nblocks, int64_t probe, float scale,
                  float *scores, int nthreads)
{
    sparse_probe_compact(kind, q, R, n_kv, group, hd, k, ks, bs, NULL, NULL, 0, table, count, nblocks,
                         probe, scale, scores, nthreads);
}

void sparse_probe_compact(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group, int64_t hd,
                          const void *k, const float *ks, int64_t bs, const void *pk, const float *pks,
                          int64_t pbs, const int32_t *table, const int32_t *count, int64_t nblocks,
                          int64_t probe, float scale, float *scores, int nthreads)
{
    const int64_t nq = R * n_kv * group;   /* query rows, each float[hd] */
    const int64_t nb = hd / QK;
    int8_t *qq = malloc((size_t)(nq * hd));
    float *qd = malloc((size_t)(nq * nb) * sizeof(float));
    if (qq == NULL || qd == NULL) {
        free(qq);
        free(qd);
        for (int64_t i = 0; i < n_kv * nblocks; i++)
            scores[i] = NAN;
        return;
    }
    if (kind != SPARSE_KV_F32)
        for (int64_t r = 0; r < nq; r++)
            quantize_q(q + r * hd, hd, qq + r * hd, qd + r * nb);
    if (probe < 1)
        probe = 1;

    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : omp_get_max_threads())
    for (int64_t pair = 0; pair < n_kv * nblocks; pair++) {
        const int64_t h = pair / nblocks, i = pair % nblocks;
        const int64_t n = count[i];
        const int64_t step = n / probe > 1 ? n / probe : 1;
        /* A full block's sampled rows j = 0, step, ... are rows j / step of its compact slab. */
        const int compact = pk != NULL && n == bs;
        const void *src = compact ? pk : k;
        const float *src_s = compact ? pks : ks;
        const int64_t row0 = compact ? slab_row(table[i], h, n_kv, pbs) : slab_row(table[i], h, n_kv, bs);
        float best = -INFINITY;
        for (int64_t j = 0; j < n; j += step) {
            const int64_t row = row0 + (compact ? j / step : j);
            for (int64_t r = 0; r < R; r++) {
                for (int64_t g = 0; g < group; g++) {
                    const int64_t qi = (r * n_kv + h) * group + g;
                    const float s = row_dot(kind, qq + qi * hd, qd + qi * nb, q + qi * hd,
                                            src, src_s, row, hd);
                    best = s > best ? s : best;
                }
            }
        }
        scores[h * nblocks + i] = best * scale;
    }
    free(qq);
    free(qd);
}

void sparse_select(const float *scores, int64_t n_kv, int64_t nb, const float *importance, int64_t k,
                   uint8_t *chosen)
{
    if (k >= nb) {
        memset(chosen, 1, (size_t)(n_kv * nb));
        return;
    }
    memset(chosen, 0, (size_t)(n_kv * nb));
    float *tmp = malloc((size_t)nb * sizeof(float));
    uint8_t *reserved = calloc((size_t)nb, 1);
    if (tmp == NULL || reserved == NULL) {   /* out of memory: fall back to every block */
        free(tmp);
        free(reserved);
        memset(chosen, 1, (size_t)(n_kv * nb));
        return;
    }
    int64_t n_reserved = 0;
    int any = 0;
    for (int64_t i = 0; importance != NULL && i < nb; i++)
        any |= importance[i] > 0.0f;
    if (any) {
        n_reserved = (k + 1) / 2 < nb ? (k + 1) / 2 : nb;
        mark_best(importance, NULL, nb, n_reserved, reserved, tmp);
    }
    const int64_t remaining = k - n_reserved;
    for (int64_t h = 0; h < n_kv; h++) {
        uint8_t *ch = chosen + h * nb;
        const int64_t weakest = mark_best(scores + h * nb, reserved, nb, remaining, ch, tmp);
        for (int64_t i = 0; i < nb; i++)
            ch[i] |= reserved[i];
        if (weakest >= 0 && !ch[nb - 1]) {   /* recency: the last block replaces the weakest pick */
            ch[weakest] = 0;
            ch[nb - 1] = 1;
        }
    }
    free(tmp);
    free(reserved);
}
