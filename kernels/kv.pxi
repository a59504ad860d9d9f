# Included by kernels.pyx: the plain-C kernels of the KV cache (kernels.h "KV cache writes" and
# "block choice of sparse attention"), which have no SIMD twin and so take no `path`.

_KV_DTYPES = {"q8": np.int8, "q4": np.uint8, "f32": np.float32}


def kv_store(str kind, x, slots, dst, scale, path="simd"):
    """Write x float32[T, n_kv, hd] into one layer's cache arrays at slots int32[T] (block*bs + offset).

    x's tokens (x[t]) may be columns of a wider matrix (the v heads of a fused projection's
    output), read in place. dst, scale: the layer's K (or V) array and its scales (kernels.h
    layouts; scale None for f32). path: q8 has a vector path ("simd", the default) and its scalar
    twin ("portable"); q4 and f32 are plain C.
    """
    cdef bint simd = _use_simd(path)
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {', '.join(_KINDS)}, not {kind!r}")
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 3:
        raise ValueError("x must be float32[T, n_kv, hd]")
    cdef Py_ssize_t ld
    try:
        ld = _row_stride(x, "x", 3, "float32 [T, n_kv, hd]")
    except ValueError:       # tokens not contiguous themselves (or misaligned): copied once
        x = np.ascontiguousarray(x)
        ld = _row_stride(x, "x", 3, "float32 [T, n_kv, hd]")
    cdef cnp.ndarray[int32_t, ndim=1, mode="c"] sl = np.ascontiguousarray(slots, dtype=np.int32)
    cdef int64_t T = x.shape[0], n_kv = x.shape[1], hd = x.shape[2]
    want = _KV_DTYPES[kind]
    cdef cnp.ndarray d = dst
    if d.dtype != want or d.ndim != 4 or not d.flags.c_contiguous or d.shape[1] != n_kv:
        raise ValueError(f"dst must be a C-contiguous {np.dtype(want)}[nblk, {n_kv}, bs, ...] array")
    cdef int64_t bs = d.shape[2]
    if d.shape[3] != (hd // 2 if kind == "q4" else hd) or hd % QK:
        raise ValueError(f"dst rows do not fit head_dim {hd}")
    cdef int64_t n_slots = d.shape[0] * bs, t
    if sl.shape[0] != T:
        raise ValueError("slots must hold one in-range slot per token")
    for t in range(T):       # in C: numpy's min and max took half of a decode step's store
        if sl[t] < 0 or sl[t] >= n_slots:
            raise ValueError("slots must hold one in-range slot per token")
    cdef cnp.ndarray s
    if kind != "f32":
        want_shape = dst.shape[:3] + ((hd // QK,) if kind == "q4" else ())
        if (not isinstance(scale, np.ndarray) or scale.dtype != np.float32 or not scale.flags.c_contiguous
                or scale.shape != want_shape):
            raise ValueError(f"scale must be the float32{list(want_shape)} scale array of this cache layer")
        s = scale
    if T == 0:
        return
    cdef int ck = _KINDS[kind]
    cdef const float *xp = <const float *>_data(x)
    cdef int64_t rows = T if ld == n_kv * hd else 1       # strided tokens: one call each, the same bits
    t = 0
    with nogil:
        while t < T:
            if ck == KV_Q8 and simd:
                kv_store_q8_simd(xp + t * ld, rows, n_kv, hd, &sl[t], bs, <int8_t *>d.data, <float *>s.data)
            elif ck == KV_Q8:
                kv_store_q8_portable(xp + t * ld, rows, n_kv, hd, &sl[t], bs, <int8_t *>d.data, <float *>s.data)
            elif ck == KV_Q4:
                kv_store_q4(xp + t * ld, rows, n_kv, hd, &sl[t], bs, <uint8_t *>d.data, <float *>s.data)
            else:
                kv_store_f32(xp + t * ld, rows, n_kv, hd, &sl[t], bs, <float *>d.data)
            t += rows


def select(scores, importance, int k):
    """bool[n_kv, nb] chosen blocks from probe scores float32[n_kv, nb] and block importance
    float32[>= nb] (or None), keeping k per head (kernels.h sparse_select)."""
    cdef cnp.ndarray[float, ndim=2, mode="c"] sc = np.ascontiguousarray(scores, dtype=np.float32)
    cdef int64_t n_kv = sc.shape[0], nb = sc.shape[1]
    cdef cnp.ndarray[float, ndim=1, mode="c"] imp
    cdef const float *impp = NULL
    if importance is not None:
        imp = np.ascontiguousarray(importance, dtype=np.float32)
        if imp.shape[0] < nb:
            raise ValueError(f"importance has {imp.shape[0]} blocks, scores {nb}")
        impp = &imp[0] if nb else NULL
    if k < 0:
        k = 0          # a budget below zero chooses nothing, as the numpy twin does
    cdef cnp.ndarray[uint8_t, ndim=2, mode="c"] out = np.empty((n_kv, nb), np.uint8)
    if n_kv and nb:
        with nogil:
            sparse_select(&sc[0, 0], n_kv, nb, impp, k, &out[0, 0])
    return out.view(bool)
