/*
 * Deterministic top-m marking for block-sparse attention: which m of n values are best,
 * ties to the lower index (what a stable descending sort takes first), in O(n) with a
 * quickselect threshold instead of a sort. Shared by the block choice (sparse_select.c)
 * and the bound probe's candidate pick (attention_probe.h); header-only so that the probe,
 * compiled once per path, inlines it.
 */
#ifndef APPLIANCE_TOPK_H
#define APPLIANCE_TOPK_H
#include <stdint.h>

/* The m-th largest of x[0..n) (1 <= m <= n), reordering x: Hoare's quickselect, O(n). */
static inline float mth_largest(float *x, int64_t n, int64_t m)
{
    int64_t lo = 0, hi = n - 1;
    const int64_t want = m - 1;          /* index of the answer in descending order */
    while (lo < hi) {
        const float pivot = x[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (x[i] > pivot)
                i++;
            while (x[j] < pivot)
                j--;
            if (i <= j) {
                const float t = x[i];
                x[i] = x[j];
                x[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return x[want];
    }
    return x[want];
}

/* Mark in `mark` the m best entries of val[0..n) that `skip` does not exclude, best = higher value,
 * ties to the lower index (what a stable descending sort takes first). Returns the index of the
 * weakest one marked (the last a stable sort would take), or -1 if none. tmp: float[n]. */
static inline int64_t mark_best(const float *val, const uint8_t *skip, int64_t n, int64_t m, uint8_t *mark,
                         float *tmp)
{
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++)
        if (skip == NULL || !skip[i])
            tmp[c++] = val[i];
    if (m > c)
        m = c;
    if (m <= 0)
        return -1;
    const float v = mth_largest(tmp, c, m);
    int64_t above = 0;
    for (int64_t i = 0; i < n; i++)
        if ((skip == NULL || !skip[i]) && val[i] > v)
            above++;
    int64_t ties = m - above, weakest = -1;   /* ties >= 1: v itself is among the m best */
    for (int64_t i = 0; i < n; i++) {
        if (skip != NULL && skip[i])
            continue;
        if (val[i] > v) {
            mark[i] = 1;
        } else if (val[i] == v && ties > 0) {
            mark[i] = 1;
            ties--;
            weakest = i;
        }
    }
    return weakest;
}

#endif
