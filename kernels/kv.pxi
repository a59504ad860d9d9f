# Included by kernels.pyx: the plain-C kernels of the KV cache (kernels.h "KV cache writes" and
# "block choice of sparse attention"), which have no SIMD twin and so take no `path`.

_KV_DTYPES = {"q8": np.int8, "q4": np.uint8, "f32": np.float32}


def kv_store(str kind, x, slots, dst, scale, path="simd"):
    """Write x float32[T, n_kv, hd] into one layer's cache arrays at slots int32[T] (block*bs + offset).

    dst, scale: the layer's K (or V) array and its scales (kernels.h layouts; scale None for f32).
    path: q8 has a vector path ("simd", the default) and its scalar twin ("portable"); q4 and f32
    are plain C.
    """
    cdef bint simd = _use_simd(path)
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {', '.join(_KINDS)}, not {kind!r}")
    cdef cnp.ndarray xa = np.ascontiguousarray(x, dtype=np.float32)
    cdef cnp.ndarray[int32_t, ndim=1, mode="c"] sl = np.ascontiguousarray(slots, dtype=np.int32)
    if xa.ndim != 3:
        raise ValueError("x must be float32[T, n_kv, hd]")
    cdef int64_t T = xa.shape[0], n_kv = xa.shape[1], hd = xa.shape[2]
    want = _KV_DTYPES[kind]
    cdef cnp.ndarray d = dst
    if d.dtype != want or d.ndim != 4 or not d.flags.c_contiguous or d.shape[1] != n_kv:
        raise ValueError(f"dst must be a C-contiguous {np.dtype(want)}[nblk, {n_kv}, bs, ...] array")
    cdef int64_t bs = d.shape[2]
    if d.shape[3] != (hd // 2 if kind == "q4" else hd) or hd % QK:
        raise ValueError(f"dst rows do not fit head_dim {hd}")
    if sl.shape[0] != T or (T and (sl.min() < 0 or sl.max() >= d.shape[0] * bs)):
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
    with nogil:
        if ck == KV_Q8 and simd:
            kv_store_q8_simd(<const float *>xa.data, T, n_kv, hd, &sl[0], bs, <int8_t *>d.data, <float *>s.data)
        elif ck == KV_Q8:
            kv_store_q8_portable(<const float *>xa.data, T, n_kv, hd, &sl[0], bs, <int8_t *>d.data, <float *>s.data)
        elif ck == KV_Q4:
            kv_store_q4(<const float *>xa.data, T, n_kv, hd, &sl[0], bs, <uint8_t *>d.data, <float *>s.data)
        else:
            kv_store_f32(<const float *>xa.data, T, n_kv, hd, &sl[0], bs, <float *>d.data)


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
