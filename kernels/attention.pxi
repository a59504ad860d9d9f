# Included by kernels.pyx: attention over the paged KV cache and the probes of block-sparse
# attention (kernels.h), with the argument checks of kernels.pyx.

# ---- attention ---------------------------------------------------------------------

cdef int _check_tables(const int32_t *table, const int32_t *blockpos, const int32_t *count,
                       Py_ssize_t n, Py_ssize_t nblk, Py_ssize_t bs) except -1:
    cdef Py_ssize_t i
    cdef Py_ssize_t bad = -1
    with nogil:
        for i in range(n):
            if table[i] < 0 or table[i] >= nblk or blockpos[i] < 0 or count[i] < 0 or count[i] > bs:
                bad = i
                break
    if bad >= 0:
        raise ValueError(f"block list entry {bad}: table={table[bad]} (nblk {nblk}), "
                         f"blockpos={blockpos[bad]} (>= 0), count={count[bad]} (0..{bs})")
    return 0


cdef int _check_list(object a, str name, Py_ssize_t ndim, Py_ssize_t n_kv, Py_ssize_t nsel) except -1:
    _check(a, name, cnp.NPY_INT32, ndim, 0, "int32 [nsel] or [n_kv, nsel]")
    if ndim == 2:
        _check_dim(_dim(a, 0), n_kv, f"{name}.shape[0] (n_kv)")
    _check_dim(_dim(a, ndim - 1), nsel, f"{name}.shape[-1] (nsel, as table)")
    return 0


cdef tuple _check_cache(int kind, object q, object k, object ks, object v, object vs):
    """Validate the queries and one cache layer; (T, Hq, hd, nblk, n_kv, bs)."""
    _check(q, "q", cnp.NPY_FLOAT32, 3, 0, "float32 [T, Hq, hd]")
    cdef Py_ssize_t T = _dim(q, 0), Hq = _dim(q, 1), hd = _dim(q, 2)
    if kind == KV_Q8:
        _check(k, "k", cnp.NPY_INT8, 4, 0, "int8 [nblk, n_kv, bs, hd]")
        _check(v, "v", cnp.NPY_INT8, 4, 0, "int8 [nblk, n_kv, bs, hd]")
        _check(ks, "ks", cnp.NPY_FLOAT32, 3, 0, "float32 [nblk, n_kv, bs]")
        _check(vs, "vs", cnp.NPY_FLOAT32, 3, 0, "float32 [nblk, n_kv, bs]")
    elif kind == KV_Q4:
        _check(k, "k", cnp.NPY_UINT8, 4, 0, "uint8 [nblk, n_kv, bs, hd/2]")
        _check(v, "v", cnp.NPY_UINT8, 4, 0, "uint8 [nblk, n_kv, bs, hd/2]")
        _check(ks, "ks", cnp.NPY_FLOAT32, 4, 0, "float32 [nblk, n_kv, bs, hd/32]")
        _check(vs, "vs", cnp.NPY_FLOAT32, 4, 0, "float32 [nblk, n_kv, bs, hd/32]")
    else:
        _check(k, "k", cnp.NPY_FLOAT32, 4, 0, "float32 [nblk, n_kv, bs, hd]")
        _check(v, "v", cnp.NPY_FLOAT32, 4, 0, "float32 [nblk, n_kv, bs, hd]")
    cdef Py_ssize_t nblk = _dim(k, 0), n_kv = _dim(k, 1), bs = _dim(k, 2)
    if hd <= 0 or hd % QK:
        raise ValueError(f"q: head_dim {hd} must be a positive multiple of {QK}")
    if n_kv <= 0 or Hq % n_kv:
        raise ValueError(f"q has {Hq} heads, not a multiple of the cache's {n_kv} kv heads")
    if bs <= 0:
        raise ValueError(f"k: block size must be positive, got {bs}")
    cdef Py_ssize_t row = hd // 2 if kind == KV_Q4 else hd
    for a, name in ((k, "k"), (v, "v")):
        _check_dim(_dim(a, 0), nblk, f"{name}.shape[0]")
        _check_dim(_dim(a, 1), n_kv, f"{name}.shape[1]")
        _check_dim(_dim(a, 2), bs, f"{name}.shape[2]")
        _check_dim(_dim(a, 3), row, f"{name}.shape[3]")
    if kind != KV_F32:
        for a, name in ((ks, "ks"), (vs, "vs")):
            _check_dim(_dim(a, 0), nblk, f"{name}.shape[0]")
            _check_dim(_dim(a, 1), n_kv, f"{name}.shape[1]")
            _check_dim(_dim(a, 2), bs, f"{name}.shape[2]")
            if kind == KV_Q4:
                _check_dim(_dim(a, 3), hd // QK, f"{name}.shape[3]")
    return T, Hq, hd, nblk, n_kv, bs


cdef object _out_like(object out, object q):
    """out float32 shaped as q, allocated when None."""
    if out is None:
        return _empty(3, _dim(q, 0), _dim(q, 1), _dim(q, 2), cnp.NPY_FLOAT32)
    _check(out, "out", cnp.NPY_FLOAT32, 3, 1, "float32 [T, Hq, hd]")
    if out.shape != q.shape:
        raise ValueError(f"out has shape {out.shape}, q has {q.shape}")
    return out


cdef object _attention(int kind, object q, object k, object ks, object v, object vs, object table,
                       object blockpos, object count, object qpos, float scale, object out,
                       object path, int threads, object importance=None):
    cdef bint simd = _use_simd(path)
    cdef int nt = _nthreads(threads)
    cdef Py_ssize_t T, Hq, hd, nblk, n_kv, bs
    T, Hq, hd, nblk, n_kv, bs = _check_cache(kind, q, k, ks, v, vs)

    if not cnp.PyArray_Check(table) or cnp.PyArray_NDIM(<cnp.ndarray>table) not in (1, 2):
        raise ValueError(f"table: expected an int32 array [nsel] or [n_kv, nsel], got {_what(table)}")
    cdef Py_ssize_t tnd = cnp.PyArray_NDIM(<cnp.ndarray>table)
    cdef Py_ssize_t nsel = _dim(table, tnd - 1)
    cdef Py_ssize_t stride = nsel if tnd == 2 else 0
    _check_list(table, "table", tnd, n_kv, nsel)
    _check_list(blockpos, "blockpos", tnd, n_kv, nsel)
    _check_list(count, "count", tnd, n_kv, nsel)
    _check(qpos, "qpos", cnp.NPY_INT32, 1, 0, "int32 [T]")
    _check_dim(_dim(qpos, 0), T, "qpos.shape[0]")
    cdef const int32_t *tp = <const int32_t *>_data(table)
    cdef const int32_t *bp = <const int32_t *>_data(blockpos)
    cdef const int32_t *cp = <const int32_t *>_data(count)
    _check_tables(tp, bp, cp, nsel * (n_kv if tnd == 2 else 1), nblk, bs)

    out = _out_like(out, q)
    cdef const float *qp = <const float *>_data(q)
    cdef const void *kp = _data(k)
    cdef const void *vp = _data(v)
    cdef const float *ksp = NULL
    cdef const float *vsp = NULL
    if kind != KV_F32:
        ksp = <const float *>_data(ks)
        vsp = <const float *>_data(vs)
    cdef const int32_t *qpp = <const int32_t *>_data(qpos)
    cdef float *op = <float *>_data(out)
    cdef Py_ssize_t group = Hq // n_kv
    cdef float *impp = NULL
    cdef Py_ssize_t npos = 0
    if importance is not None:
        _check(importance, "importance", cnp.NPY_FLOAT32, 1, 1, "float32 [n_positions]")
        impp = <float *>_data(importance)
        npos = _dim(importance, 0)
    if T == 0 or Hq == 0:
        return out
    if nblk == 0 or nsel == 0:
        (<cnp.ndarray>out).fill(0.0)
        return out
    if impp != NULL:
        with nogil:
            if simd:
                attention_importance_simd(kind, qp, T, n_kv, group, hd, kp, ksp, vp, vsp, bs, tp, bp, cp,
                                          nsel, stride, qpp, scale, op, impp, npos, nt)
            else:
                attention_importance_portable(kind, qp, T, n_kv, group, hd, kp, ksp, vp, vsp, bs, tp, bp, cp,
                                              nsel, stride, qpp, scale, op, impp, npos, nt)
        return out
    with nogil:
        if kind == KV_Q8 and simd:
            attention_q8_simd(qp, T, n_kv, group, hd, <const int8_t *>kp, ksp, <const int8_t *>vp, vsp,
                              bs, tp, bp, cp, nsel, stride, qpp, scale, op, nt)
        elif kind == KV_Q8:
            attention_q8_portable(qp, T, n_kv, group, hd, <const int8_t *>kp, ksp, <const int8_t *>vp, vsp,
                                  bs, tp, bp, cp, nsel, stride, qpp, scale, op, nt)
        elif kind == KV_Q4 and simd:
            attention_q4_simd(qp, T, n_kv, group, hd, <const uint8_t *>kp, ksp, <const uint8_t *>vp, vsp,
                              bs, tp, bp, cp, nsel, stride, qpp, scale, op, nt)
        elif kind == KV_Q4:
            attention_q4_portable(qp, T, n_kv, group, hd, <const uint8_t *>kp, ksp, <const uint8_t *>vp, vsp,
                                  bs, tp, bp, cp, nsel, stride, qpp, scale, op, nt)
        elif simd:
            attention_f32_simd(qp, T, n_kv, group, hd, <const float *>kp, <const float *>vp,
                               bs, tp, bp, cp, nsel, stride, qpp, scale, op, nt)
        else:
            attention_f32_portable(qp, T, n_kv, group, hd, <const float *>kp, <const float *>vp,
                                   bs, tp, bp, cp, nsel, stride, qpp, scale, op, nt)
    _hold_if_stale((k, ks, v, vs))   # a decode call's late worker reads the cache (attention_decode.h)
    return out


def attention_q8(q, k, ks, v, vs, table, blockpos, count, qpos, float scale, out=None,
                 path="simd", int threads=0, importance=None):
    """One-pass attention over a q8 paged cache (see kernels.h for the block-list semantics).

    q float32[T, Hq, hd]; k, v int8[nblk, n_kv, bs, hd]; ks, vs float32[nblk, n_kv, bs];
    table/blockpos/count int32[nsel] (shared by all heads) or int32[n_kv, nsel] (per head);
    qpos int32[T]. Returns float32[T, Hq, hd]; a query that sees no row gets zeros.
    importance float32[n_positions], if given, gets += the softmax weight every query head
    gave each position (block-sparse prefill; kernels.h attention_importance_*).
    """
    return _attention(KV_Q8, q, k, ks, v, vs, table, blockpos, count, qpos, scale, out, path, threads,
                      importance)


def attention_q4(q, k, ks, v, vs, table, blockpos, count, qpos, float scale, out=None,
                 path="simd", int threads=0, importance=None):
    """As attention_q8 over a q4 cache: k, v uint8[nblk, n_kv, bs, hd/2] (Q4_0 nibbles),
    ks, vs float32[nblk, n_kv, bs, hd/32]."""
    return _attention(KV_Q4, q, k, ks, v, vs, table, blockpos, count, qpos, scale, out, path, threads,
                      importance)


def attention_f32(q, k, v, table, blockpos, count, qpos, float scale, out=None, path="simd",
                  int threads=0, importance=None):
    """As attention_q8 over an unquantized cache (a debugging probe): k, v float32[nblk, n_kv, bs, hd]."""
    return _attention(KV_F32, q, k, None, v, None, table, blockpos, count, qpos, scale, out, path,
                      threads, importance)


# The cache formats by name (the KV writes in kv.pxi take the same names).
_KINDS = {"q8": KV_Q8, "q4": KV_Q4, "f32": KV_F32}


def attention_batch(str kind, q, k, ks, v, vs, seq_rows, seq_lists, table, blockpos, count, qpos,
                    float scale, out=None, path="simd", int threads=0):
    """One attention call for several sequences, their work spread over the threads together
    (a decode step's batch; kernels.h attention_batch).

    kind "q8" | "q4" | "f32" (ks, vs None for f32); q float32[T, Hq, hd] holds every sequence's rows,
    sequence s rows seq_rows[s] .. seq_rows[s+1]-1 (seq_rows int64[nseq+1], from 0 to T);
    seq_lists int64[nseq, 3]: (list0, nsel, stride) of its blocks in table/blockpos/count
    (int32[entries]): kv head h reads entries list0 + h*stride + i, i < nsel (stride 0: every head
    the same list); qpos int32[T]. Each sequence's rows of the result equal attention_<kind> of its
    rows and list alone, bit for bit.
    """
    cdef int c_kind = _probe_kind(kind)
    cdef bint simd = _use_simd(path)
    cdef int nt = _nthreads(threads)
    cdef Py_ssize_t T, Hq, hd, nblk, n_kv, bs
    T, Hq, hd, nblk, n_kv, bs = _check_cache(c_kind, q, k, ks, v, vs)
    _check(seq_rows, "seq_rows", cnp.NPY_INT64, 1, 0, "int64 [nseq+1]")
    _check(seq_lists, "seq_lists", cnp.NPY_INT64, 2, 0, "int64 [nseq, 3]")
    cdef Py_ssize_t nseq = _dim(seq_lists, 0)
    _check_dim(_dim(seq_lists, 1), 3, "seq_lists.shape[1]")
    _check_dim(_dim(seq_rows, 0), nseq + 1, "seq_rows.shape[0] (nseq + 1)")
    for a, name in ((table, "table"), (blockpos, "blockpos"), (count, "count")):
        _check(a, name, cnp.NPY_INT32, 1, 0, "int32 [entries]")
    cdef Py_ssize_t entries = _dim(table, 0)
    _check_dim(_dim(blockpos, 0), entries, "blockpos.shape[0] (entries, as table)")
    _check_dim(_dim(count, 0), entries, "count.shape[0] (entries, as table)")
    _check(qpos, "qpos", cnp.NPY_INT32, 1, 0, "int32 [T]")
    _check_dim(_dim(qpos, 0), T, "qpos.shape[0]")
    cdef const int64_t *rp = <const int64_t *>_data(seq_rows)
    cdef const int64_t *lp = <const int64_t *>_data(seq_lists)
    cdef Py_ssize_t s, last
    if rp[0] != 0 or rp[nseq] != T:
        raise ValueError(f"seq_rows must run from 0 to T = {T}, got {rp[0]} .. {rp[nseq]}")
    for s in range(nseq):
        if rp[s + 1] < rp[s]:
            raise ValueError(f"seq_rows must not decrease (sequence {s}: {rp[s]} .. {rp[s + 1]})")
        if lp[3 * s] < 0 or lp[3 * s + 1] < 0 or lp[3 * s + 2] < 0 or (lp[3 * s + 2] and lp[3 * s + 2] < lp[3 * s + 1]):
            raise ValueError(f"seq_lists[{s}] = ({lp[3 * s]}, {lp[3 * s + 1]}, {lp[3 * s + 2]}): list0 and nsel must be >= 0 and "
                             f"stride 0 or at least nsel")
        last = lp[3 * s] + (n_kv - 1) * lp[3 * s + 2] + lp[3 * s + 1]
        if lp[3 * s + 1] and last > entries:
            raise ValueError(f"seq_lists[{s}] reaches list entry {last - 1}, the table has {entries}")
    cdef const int32_t *tp = <const int32_t *>_data(table)
    cdef const int32_t *bp = <const int32_t *>_data(blockpos)
    cdef const int32_t *cp = <const int32_t *>_data(count)
    _check_tables(tp, bp, cp, entries, nblk, bs)
    out = _out_like(out, q)
    if T == 0 or Hq == 0:
        return out
    cdef const float *qp = <const float *>_data(q)
    cdef const void *kp = _data(k)
    cdef const void *vp = _data(v)
    cdef const float *ksp = NULL
    cdef const float *vsp = NULL
    if c_kind != KV_F32:
        ksp = <const float *>_data(ks)
        vsp = <const float *>_data(vs)
    cdef const int32_t *qpp = <const int32_t *>_data(qpos)
    cdef float *op = <float *>_data(out)
    cdef int64_t c_nseq = nseq, c_nkv = n_kv, c_group = Hq // n_kv, c_hd = hd, c_bs = bs
    with nogil:
        if simd:
            attention_batch_simd(c_kind, qp, c_nseq, rp, lp, c_nkv, c_group, c_hd, kp, ksp, vp, vsp, c_bs,
                                 tp, bp, cp, qpp, scale, op, nt)
        else:
            attention_batch_portable(c_kind, qp, c_nseq, rp, lp, c_nkv, c_group, c_hd, kp, ksp, vp, vsp, c_bs,
                                     tp, bp, cp, qpp, scale, op, nt)
    _hold_if_stale((k, ks, v, vs))
    return out


cdef int _probe_kind(str kind) except -1:
    if kind not in _KINDS:
        raise ValueError(f"kind must be q8, q4 or f32, not {kind!r}")
    return _KINDS[kind]


cdef object _check_probe_args(int c_kind, object q, object k, object ks, object table, object count):
    """Validate the arguments both probes share; returns (want dtype pair, R, Hq, hd, nblk, n_kv, bs, nblocks)."""
    _check(q, "q", cnp.NPY_FLOAT32, 3, 0, "float32 [R, Hq, hd]")
    want = {KV_Q8: (cnp.NPY_INT8, "int8"), KV_Q4: (cnp.NPY_UINT8, "uint8"),
            KV_F32: (cnp.NPY_FLOAT32, "float32")}[c_kind]
    _check(k, "k", want[0], 4, 0, f"{want[1]} [nblk, n_kv, bs, row]")
    cdef Py_ssize_t R = _dim(q, 0), Hq = _dim(q, 1), hd = _dim(q, 2)
    cdef Py_ssize_t nblk = _dim(k, 0), n_kv = _dim(k, 1), bs = _dim(k, 2)
    if hd <= 0 or hd % QK:
        raise ValueError(f"q: head_dim {hd} must be a positive multiple of {QK}")
    if n_kv <= 0 or Hq % n_kv:
        raise ValueError(f"q has {Hq} heads, not a multiple of the cache's {n_kv} kv heads")
    _check_dim(_dim(k, 3), hd // 2 if c_kind == KV_Q4 else hd, "k.shape[3]")
    if c_kind != KV_F32:
        _check(ks, "ks", cnp.NPY_FLOAT32, 3 if c_kind == KV_Q8 else 4, 0, "float32 K scales")
        if tuple(ks.shape[:3]) != (nblk, n_kv, bs):
            raise ValueError(f"ks has shape {ks.shape}, k has {k.shape}")
    _check(table, "table", cnp.NPY_INT32, 1, 0, "int32 [nblocks]")
    _check(count, "count", cnp.NPY_INT32, 1, 0, "int32 [nblocks]")
    cdef Py_ssize_t nblocks = _dim(table, 0)
    _check_dim(_dim(count, 0), nblocks, "count.shape[0]")
    cdef const int32_t *tp = <const int32_t *>_data(table)
    cdef const int32_t *cp = <const int32_t *>_data(count)
    cdef Py_ssize_t i
    for i in range(nblocks):
        if tp[i] < 0 or tp[i] >= nblk or cp[i] < 0 or cp[i] > bs:
            raise ValueError(f"table/count entry {i} ({tp[i]}, {cp[i]}) is out of range for this cache")
    return want, R, Hq, hd, nblk, n_kv, bs, nblocks


def attention_probe(str kind, q, k, ks, table, count, int probe, float scale, pk=None, pks=None,
                    path="simd", int threads=0):
    """float32[n_kv, nblocks] block-sparse probe scores over one cache layer (kernels.h).

    kind "q8" | "q4" | "f32"; q float32[R, Hq, hd]; k, ks the layer's K arrays as in
    attention_*; table, count int32[nblocks]; pk, pks the layer's compact copy of the probed
    rows (PagedKVCache.enable_probe_rows), read for full blocks, or None.
    """
    cdef int c_kind = _probe_kind(kind)
    cdef bint simd = _use_simd(path)
    want, R, Hq, hd, nblk, n_kv, bs, nblocks = _check_probe_args(c_kind, q, k, ks, table, count)
    cdef Py_ssize_t pbs = 0
    if pk is not None:
        if probe < 1 or bs // probe < 1:
            raise ValueError(f"compact probe rows need 1 <= probe <= block size {bs}")
        pbs = (bs + bs // probe - 1) // (bs // probe)   # ceil; C division here (cdivision)
        _check(pk, "pk", want[0], 4, 0, f"{want[1]} [nblk, n_kv, {pbs}, row]")
        if tuple(pk.shape) != (nblk, n_kv, pbs, k.shape[3]):
            raise ValueError(f"pk has shape {pk.shape}: not the compact probe rows of k {k.shape} "
                             f"for probe {probe}")
        if c_kind != KV_F32:
            _check(pks, "pks", cnp.NPY_FLOAT32, ks.ndim, 0, "float32 compact K scales")
            if tuple(pks.shape) != (nblk, n_kv, pbs) + tuple(ks.shape[3:]):
                raise ValueError(f"pks has shape {pks.shape}, pk has {pk.shape}")
    out = np.empty((n_kv, nblocks), np.float32)
    if nblocks == 0 or R == 0:
        out.fill(-np.inf)
        return out
    cdef const float *qp = <const float *>_data(q)
    cdef const void *kp = _data(k)
    cdef const float *ksp = NULL
    cdef const void *pkp = NULL
    cdef const float *pksp = NULL
    if c_kind != KV_F32:
        ksp = <const float *>_data(ks)
    if pk is not None:
        pkp = _data(pk)
        if c_kind != KV_F32:
            pksp = <const float *>_data(pks)
    cdef float *op = <float *>_data(out)
    cdef const int32_t *tp = <const int32_t *>_data(table)
    cdef const int32_t *cp = <const int32_t *>_data(count)
    cdef int64_t c_R = R, c_nkv = n_kv, c_group = Hq // n_kv, c_hd = hd, c_bs = bs, c_pbs = pbs
    cdef int64_t c_nblocks = nblocks
    cdef int nt = _nthreads(threads)
    with nogil:
        if simd:
            attention_probe_simd(c_kind, qp, c_R, c_nkv, c_group, c_hd, kp, ksp, c_bs, pkp, pksp, c_pbs, tp, cp,
                                 c_nblocks, probe, scale, op, nt)
        else:
            attention_probe_portable(c_kind, qp, c_R, c_nkv, c_group, c_hd, kp, ksp, c_bs, pkp, pksp, c_pbs,
                                     tp, cp, c_nblocks, probe, scale, op, nt)
    return out


def attention_probe_bound(str kind, q, k, ks, bk, bks, table, count, int ncand, float scale, path="simd",
                          int threads=0):
    """float32[n_kv, nblocks] bound-probe scores over one cache layer (kernels.h): the exact max
    q . K of the ncand full blocks with the highest key bound and of every block not full,
    -inf for the rest.

    kind, q, k, ks, table, count as attention_probe; bk int8[nblk, n_kv, 2, hd] and
    bks float32[nblk, n_kv, 2] the layer's bound rows (PagedKVCache.enable_bound_rows).
    """
    cdef int c_kind = _probe_kind(kind)
    cdef bint simd = _use_simd(path)
    want, R, Hq, hd, nblk, n_kv, bs, nblocks = _check_probe_args(c_kind, q, k, ks, table, count)
    if ncand < 0:
        raise ValueError(f"ncand must be >= 0, got {ncand}")
    _check(bk, "bk", cnp.NPY_INT8, 4, 0, "int8 [nblk, n_kv, 2, hd]")
    _check(bks, "bks", cnp.NPY_FLOAT32, 3, 0, "float32 [nblk, n_kv, 2]")
    if tuple(bk.shape) != (nblk, n_kv, 2, hd) or tuple(bks.shape) != (nblk, n_kv, 2):
        raise ValueError(f"bound rows have shapes {bk.shape} and {bks.shape}; this cache needs "
                         f"{(nblk, n_kv, 2, hd)} and {(nblk, n_kv, 2)}")
    out = np.empty((n_kv, nblocks), np.float32)
    if nblocks == 0 or R == 0:
        out.fill(-np.inf)
        return out
    cdef const float *qp = <const float *>_data(q)
    cdef const void *kp = _data(k)
    cdef const float *ksp = NULL
    if c_kind != KV_F32:
        ksp = <const float *>_data(ks)
    cdef const int8_t *bkp = <const int8_t *>_data(bk)
    cdef const float *bksp = <const float *>_data(bks)
    cdef float *op = <float *>_data(out)
    cdef const int32_t *tp = <const int32_t *>_data(table)
    cdef const int32_t *cp = <const int32_t *>_data(count)
    cdef int64_t c_R = R, c_nkv = n_kv, c_group = Hq // n_kv, c_hd = hd, c_bs = bs
    cdef int64_t c_nblocks = nblocks, c_ncand = ncand
    cdef int nt = _nthreads(threads)
    with nogil:
        if simd:
            attention_probe_bound_simd(c_kind, qp, c_R, c_nkv, c_group, c_hd, kp, ksp, c_bs, bkp, bksp, tp, cp,
                                       c_nblocks, c_ncand, scale, op, nt)
        else:
            attention_probe_bound_portable(c_kind, qp, c_R, c_nkv, c_group, c_hd, kp, ksp, c_bs, bkp, bksp, tp,
                                           cp, c_nblocks, c_ncand, scale, op, nt)
    return out
