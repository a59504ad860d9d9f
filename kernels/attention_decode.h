/*
 * Decode-sized attention as a pool_run_out job (pool.h), part of the attention template
 * (attention_driver.h): every sequence's queries fit one tile (a decode step, its batch, a short
 * check of drafted tokens). A worker that loses its core while it holds a unit then does not hold
 * up the step: the caller takes the unit back and scans it itself.
 *
 * So a unit writes no output row. It leaves its heads' running max, sum and accumulators in its own
 * slice of a parts buffer (the job's y), and once every unit is in, the caller merges each
 * (sequence, kv head) pair's parts with merge_parts, in part order, as the other route merges
 * long lists: both routes give the same results. A worker the caller took a unit back from may
 * still scan it after the call returned, so what it reads besides the cache arrays lives in the
 * job's block, copied: the queries, their positions and the block lists (a few KB a decode step).
 * The cache arrays are the operands the binding holds (kernel_pool_last_stale).
 */

/* Unit `chunk` into its slice of y: per kv head hh of the unit, at hh * R * (hd + 2), acc
 * float[R, hd], mx float[R], sum float[R] (merge_parts' layout of a part). */
static void ATTN_NAME(decode_unit)(const void *ctx, int64_t chunk, float *y)
{
    const struct attn_job *j = ctx;
    struct attn_unit_at u;
    attn_locate(j, chunk, &u);
    const int64_t R = j->R, hd = j->hd, part_floats = R * (hd + 2);
    float *const slice = y + chunk * j->unit_floats;
    struct attn_buffers b;
    unsigned char *base = ATTN_NAME(attention_scratch)(&b, R, j->hper, hd, j->ld, j->bs, 0, 0);
    if (base != NULL)
        ATTN_NAME(unit_scan)(j, &u, &b);
    for (int64_t hh = 0; hh < u.nh; hh++) {
        float *const part = slice + hh * part_floats;
        if (base == NULL) {   /* out of memory: NaN rows, not a crash */
            for (int64_t i = 0; i < u.rows * hd; i++)
                part[i] = NAN;
            for (int64_t r = 0; r < u.rows; r++) {
                part[R * hd + r] = 0.0f;
                part[R * hd + R + r] = 1.0f;
            }
            continue;
        }
        attn_store_part(part, &b, hh, R, hd, u.rows);
    }
    free(base);
}

static void ATTN_NAME(decode_rect)(const void *ctx, int64_t chunk, int64_t *m0, int64_t *m1, int64_t *n0,
                                   int64_t *n1)
{
    const struct attn_job *j = ctx;
    *m0 = 0;
    *m1 = 1;
    *n0 = chunk * j->unit_floats;
    *n1 = *n0 + j->unit_floats;
}

/* Run the units of `cut` (a job as attention_run cut it, every sequence in one tile) and write
 * the output rows; T: the call's query rows. */
static void ATTN_NAME(attention_decode)(const struct attn_job *cut, int64_t nunits, int nt, int64_t T)
{
    const int64_t n_kv = cut->n_kv, group = cut->group, hd = cut->hd, R = cut->R, Hq = n_kv * group;
    const int64_t unit_floats = cut->hper * R * (hd + 2), part_floats = R * (hd + 2);
    int64_t entries = 0;   /* block-list entries the units read */
    for (int64_t si = 0; si < cut->nseq; si++) {
        const struct attn_seq *sq = &cut->seqs[si];
        const int64_t end = sq->list0 + (n_kv - 1) * sq->stride + sq->nsel;
        if (sq->ntiles > 0 && end > entries)
            entries = end;
    }
    const size_t seq_bytes = (size_t)cut->nseq * sizeof(struct attn_seq);
    const size_t q_bytes = (size_t)(T * Hq * hd) * sizeof(float), pos_bytes = (size_t)T * sizeof(int32_t);
    const size_t list_bytes = (size_t)entries * sizeof(int32_t);
    unsigned char *blk = malloc(sizeof(struct attn_job) + seq_bytes + q_bytes + pos_bytes + 3 * list_bytes);
    float *parts = malloc((size_t)(nunits * unit_floats) * sizeof(float));
    if (blk == NULL || parts == NULL) {   /* out of memory: NaN where the results go */
        for (int64_t i = 0; i < T * Hq * hd; i++)
            cut->out[i] = NAN;
        free(blk);
        free(parts);
        return;
    }
    /* The block: the job, then its copies of what a late worker may read. */
    struct attn_job *j = (struct attn_job *)blk;
    unsigned char *p = blk + sizeof *j;
    *j = *cut;
    j->seqs = memcpy(p, cut->seqs, seq_bytes);
    p += seq_bytes;
    j->q = memcpy(p, cut->q, q_bytes);
    p += q_bytes;
    j->qpos = memcpy(p, cut->qpos, pos_bytes);
    p += pos_bytes;
    j->table = memcpy(p, cut->table, list_bytes);
    j->blockpos = memcpy(p + list_bytes, cut->blockpos, list_bytes);
    j->count = memcpy(p + 2 * list_bytes, cut->count, list_bytes);
    j->unit_floats = unit_floats;
    j->out = NULL;
    pool_run_out(KERNEL_ATTENTION, nt, nunits, ATTN_NAME(decode_unit), ATTN_NAME(decode_rect), j, parts, 1,
                  nunits * unit_floats);   /* the block is the pool's from here on */

    for (int64_t si = 0; si < cut->nseq; si++) {
        const struct attn_seq *sq = &cut->seqs[si];
        if (sq->ntiles == 0)
            continue;   /* zeros, written by attention_run */
        const int64_t rows = sq->T * group;
        for (int64_t h = 0; h < n_kv; h++) {
            /* units of the sequence: (head range, tile 0, part), the parts of one range side by side */
            const int64_t hg = h / cut->hper, hh = h % cut->hper;
            const float *first = parts + (sq->unit0 + hg * sq->nsplits) * unit_floats + hh * part_floats;
            float *orow[ATTN_QTILE * ATTN_MAX_GROUP];
            for (int64_t r = 0; r < rows; r++)
                orow[r] = attn_out_row(cut, sq, 0, h, r);
            ATTN_NAME(merge_parts)(first, unit_floats, sq->nsplits, rows, R, hd, orow);
        }
    }
    free(parts);
}

