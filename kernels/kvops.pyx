# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""appliance._kvops: KV cache writes (kernels/kv_store.h) and the probe and block choice of
block-sparse attention (kernels/sparse_attention.h)."""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int8_t, uint8_t, int32_t, int64_t

cnp.import_array()

cdef extern from "kv_store.h" nogil:
    void kv_store_q8(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                     int8_t *dst, float *scale)
    void kv_store_q4(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                     uint8_t *dst, float *scale)
    void kv_store_f32(const float *x, int64_t T, int64_t n_kv, int64_t hd, const int32_t *slot, int64_t bs,
                      float *dst)

cdef extern from "sparse_attention.h" nogil:
    void sparse_probe(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group, int64_t hd,
                      const void *k, const float *ks, int64_t bs, const int32_t *table,
                      const int32_t *count, int64_t nblocks, int64_t probe, float scale,
                      float *scores, int nthreads)
    void sparse_probe_compact(int kind, const float *q, int64_t R, int64_t n_kv, int64_t group, int64_t hd,
                              const void *k, const float *ks, int64_t bs, const void *pk, const float *pks,
                              int64_t pbs, const int32_t *table, const int32_t *count, int64_t nblocks,
                              int64_t probe, float scale, float *scores, int nthreads)
    void sparse_select(const float *scores, int64_t n_kv, int64_t nb, const float *importance, int64_t k,
                       uint8_t *chosen)

KINDS = {"q8": 0, "q4": 1, "f32": 2}


def kv_store(str kind, x, slots, dst, scale):
    """Write x float32[T, n_kv, hd] into one layer's cache arrays at slots int32[T] (block*bs + offset)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    cdef cnp.ndarray xa = np.ascontiguousarray(x, dtype=np.float32)
    cdef cnp.ndarray[int32_t, ndim=1, mode="c"] sl = np.ascontiguousarray(slots, dtype=np.int32)
    if xa.ndim != 3:
        raise ValueError("x must be float32[T, n_kv, hd]")
    cdef int64_t T = xa.shape[0], n_kv = xa.shape[1], hd = xa.shape[2]
    want = {"q8": np.int8, "q4": np.uint8, "f32": np.float32}[kind]
    cdef cnp.ndarray d = dst
    if d.dtype != want or d.ndim != 4 or not d.flags.c_contiguous or d.shape[1] != n_kv:
        raise ValueError(f"dst must be a C-contiguous {np.dtype(want)}[nblk, {n_kv}, bs, ...] array")
    cdef int64_t bs = d.shape[2]
    if d.shape[3] != (hd // 2 if kind == "q4" else hd) or hd % 32:
        raise ValueError(f"dst rows do not fit head_dim {hd}")
    if sl.shape[0] != T or (T and (sl.min() < 0 or sl.max() >= d.shape[0] * bs)):
        raise ValueError("slots must hold one in-range slot per token")
    cdef cnp.ndarray s
    if kind != "f32":
        s = scale
        if s.dtype != np.float32 or not s.flags.c_contiguous or s.shape[0] != d.shape[0] or s.shape[2] != bs:
            raise ValueError("scale must be the float32 scale array of this cache layer")
    if T == 0:
        return
    cdef int ck = KINDS[kind]
    with nogil:
        if ck == 0:
            kv_store_q8(<const float *>xa.data, T, n_kv, hd, &sl[0], bs, <int8_t *>d.data, <float *>s.data)
        elif ck == 1:
            kv_store_q4(<const float *>xa.data, T, n_kv, hd, &sl[0], bs, <uint8_t *>d.data, <float *>s.data)
        else:
            kv_store_f32(<const float *>xa.data, T, n_kv, hd, &sl[0], bs, <float *>d.data)


cdef tuple _cache_args(str kind, object q, object k, object ks):
    """Check q float32[R, Hq, hd] and the cache arrays of one layer; (n_kv, group, hd, bs)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if q.dtype != np.float32 or q.ndim != 3 or not q.flags.c_contiguous:
        raise ValueError("q must be a C-contiguous float32[R, Hq, hd] array")
    want = {"q8": np.int8, "q4": np.uint8, "f32": np.float32}[kind]
    if k.dtype != want or k.ndim != 4 or not k.flags.c_contiguous:
        raise ValueError(f"k must be a C-contiguous {np.dtype(want)}[nblk, n_kv, bs, ...] array for {kind}")
    if kind != "f32" and (ks is None or ks.dtype != np.float32 or not ks.flags.c_contiguous):
        raise ValueError("ks must be a C-contiguous float32 array of K scales")
    n_kv, bs = k.shape[1], k.shape[2]
    hd = q.shape[2]
    if hd % 32 or q.shape[1] % n_kv:
        raise ValueError(f"q heads {q.shape[1]} / head_dim {hd} do not fit the cache's {n_kv} kv heads")
    return n_kv, q.shape[1] // n_kv, hd, bs


def probe(str kind, q, k, ks, table, count, int probe, float scale, int threads=0, pk=None, pks=None):
    """float32[n_kv, nblocks] block scores (see sparse_attention.h).

    pk, pks: the layer's compact copy of the probed rows (PagedKVCache.enable_probe_rows), read
    for full blocks instead of the strided rows of k (the same values: the same scores)."""
    n_kv, group, hd, bs = _cache_args(kind, q, k, ks)
    cdef int64_t pbs = 0
    cdef cnp.ndarray pka
    cdef const void *pkp = NULL
    cdef const float *pksp = NULL
    cdef cnp.ndarray pksa
    if pk is not None:
        if probe < 1 or bs // probe < 1:
            raise ValueError(f"compact probe rows need 1 <= probe <= block size {bs}")
        if (pk.dtype != k.dtype or pk.ndim != 4 or not pk.flags.c_contiguous or pk.shape[0] != k.shape[0]
                or pk.shape[1] != n_kv or pk.shape[2] != (bs + bs // probe - 1) // (bs // probe) or pk.shape[3] != k.shape[3]):
            raise ValueError("pk must be the compact probe rows of this cache layer")
        if kind != "f32" and (pks is None or pks.dtype != np.float32 or not pks.flags.c_contiguous
                              or pks.shape[:3] != pk.shape[:3]):
            raise ValueError("pks must be the float32 scales of the compact probe rows")
        pka = pk
        pkp = <const void *>pka.data
        pbs = pk.shape[2]
        if kind != "f32":
            pksa = pks
            pksp = <const float *>pksa.data
    cdef cnp.ndarray[int32_t, ndim=1, mode="c"] tab = np.ascontiguousarray(table, dtype=np.int32)
    cdef cnp.ndarray[int32_t, ndim=1, mode="c"] cnt = np.ascontiguousarray(count, dtype=np.int32)
    if tab.shape[0] != cnt.shape[0]:
        raise ValueError("table and count must have the same length")
    if tab.shape[0] and (tab.min() < 0 or tab.max() >= k.shape[0] or cnt.min() < 0 or cnt.max() > bs):
        raise ValueError("table or count out of range for this cache")
    cdef cnp.ndarray[float, ndim=2, mode="c"] out = np.empty((n_kv, tab.shape[0]), np.float32)
    cdef cnp.ndarray qa = q
    cdef cnp.ndarray ka = k
    cdef const float *ksp = NULL
    cdef cnp.ndarray ksa
    if ks is not None:
        ksa = ks
        ksp = <const float *>ksa.data
    cdef int c_kind = KINDS[kind]
    cdef int64_t R = q.shape[0], nblocks = tab.shape[0], c_nkv = n_kv, c_group = group, c_hd = hd, c_bs = bs
    with nogil:
        sparse_probe_compact(c_kind, <const float *>qa.data, R, c_nkv, c_group, c_hd, <const void *>ka.data,
                             ksp, c_bs, pkp, pksp, pbs, &tab[0] if nblocks else NULL,
                             &cnt[0] if nblocks else NULL, nblocks, probe, scale,
                             &out[0, 0] if nblocks else NULL, threads)
    return out


def select(scores, importance, int k):
    """bool[n_kv, nb] chosen blocks: the C twin of appliance.sparse.select_blocks."""
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
        k = 0          # a budget below zero chooses nothing, as select_blocks does
    cdef cnp.ndarray[uint8_t, ndim=2, mode="c"] out = np.empty((n_kv, nb), np.uint8)
    if n_kv and nb:
        with nogil:
            sparse_select(&sc[0, 0], n_kv, nb, impp, k, &out[0, 0])
    return out.view(bool)
