/* The block choice of block-sparse attention (kernels.h, "block choice"); the numpy twin is
 * appliance.kernels.reference.select. */
#include <stdlib.h>
#include "internal.h"
#include "topk.h"

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
