# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""appliance._kernels: thin wrappers over the C kernels of kernels/kernels.h.

Every function takes `path="simd"` (the build's best path; see kernel_path()) or
`path="portable"` (the plain C reference), validates shapes, dtypes and contiguity
(a wrong call raises ValueError, it never reaches C), then releases the GIL for the
kernel. `threads=0` means the module default, set_threads(n).
Integer weights/activations must lie in [-127, 127], which is what appliance.quant and
quantize_rows_q8 produce (the SIMD dot products rely on it).
"""
import numpy as np

cimport numpy as cnp
cimport openmp
from libc.stdint cimport int8_t, uint8_t, uint16_t, int32_t, int64_t

# The contract, declared once in kernels.pxd (explicit: this module is appliance._kernels,
# so Cython would not pair it with kernels.pxd by name).
from kernels cimport *

cnp.import_array()

cdef int _threads = max(1, openmp.omp_get_max_threads())


def set_threads(int n):
    """Default OpenMP thread count of the parallel kernels (threads=0 in a call)."""
    global _threads
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    _threads = n


def get_threads():
    return _threads


def kernel_path():
    """'neon-dotprod' | 'neon' | 'avx2' | 'portable': what path='simd' runs in this build."""
    return (<bytes>c_kernel_path()).decode()


def cpu_supported():
    """True if this CPU can execute the compiled SIMD path (AT_HWCAP / cpuid)."""
    return bool(kernel_cpu_supported())


def cpu_features():
    return (<bytes>kernel_cpu_features()).decode()


# ---- argument checks -------------------------------------------------------------
# numpy's C API rather than typed memoryviews: acquiring a memoryview costs ~0.5 us per
# array, these checks ~50 ns, and a decode step makes ~300 calls.

cdef inline bint _use_simd(object path) except -1:
    if path == "simd":
        return 1
    if path == "portable":
        return 0
    raise ValueError(f"path must be 'simd' or 'portable', not {path!r}")


cdef inline int _nthreads(int threads) except -1:
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = module default), got {threads}")
    return threads if threads > 0 else _threads


cdef str _what(object a):
    if isinstance(a, np.ndarray):
        layout = "C-contiguous" if a.flags.c_contiguous else "non-contiguous"
        ro = "" if a.flags.writeable else " read-only"
        return f"{layout}{ro} {a.dtype} array of shape {a.shape}"
    return type(a).__name__


cdef int _check(object a, str name, int typenum, int ndim, bint writable, str want) except -1:
    """a is a C-contiguous, aligned, native-order ndarray of typenum with ndim dimensions.
    float16 arrays may also come as their uint16 bits (kernels.h takes the bits)."""
    cdef cnp.ndarray arr
    cdef int t
    if cnp.PyArray_Check(a):
        arr = <cnp.ndarray>a
        t = cnp.PyArray_TYPE(arr)
        if ((t == typenum or (typenum == cnp.NPY_FLOAT16 and t == cnp.NPY_UINT16))
                and cnp.PyArray_NDIM(arr) == ndim and cnp.PyArray_IS_C_CONTIGUOUS(arr)
                and cnp.PyArray_ISBEHAVED_RO(arr) and (not writable or cnp.PyArray_ISWRITEABLE(arr))):
            return 0
    w = "writable " if writable else ""
    raise ValueError(f"{name}: expected a C-contiguous {w}{want} array, got {_what(a)}")


cdef inline Py_ssize_t _dim(object a, int i) noexcept:
    return cnp.PyArray_DIMS(<cnp.ndarray>a)[i]


cdef inline void *_data(object a) noexcept:
    return cnp.PyArray_DATA(<cnp.ndarray>a)


cdef inline int _check_k(Py_ssize_t K, str name) except -1:
    if K <= 0 or K % QK:
        raise ValueError(f"{name}: K = {K} must be a positive multiple of {QK}")
    return 0


cdef inline int _check_dim(Py_ssize_t got, Py_ssize_t want, str what) except -1:
    if got != want:
        raise ValueError(f"{what} is {got}, expected {want}")
    return 0


cdef inline object _empty(int nd, Py_ssize_t d0, Py_ssize_t d1, Py_ssize_t d2, int typenum):
    cdef cnp.npy_intp dims[3]
    dims[0] = d0
    dims[1] = d1
    dims[2] = d2
    return cnp.PyArray_EMPTY(nd, dims, typenum, 0)


cdef object _out2(object out, Py_ssize_t M, Py_ssize_t N):
    """out float32[M, N], allocated when None."""
    if out is None:
        return _empty(2, M, N, 0, cnp.NPY_FLOAT32)
    _check(out, "out", cnp.NPY_FLOAT32, 2, 1, "float32 2-D")
    _check_dim(_dim(out, 0), M, "out.shape[0]")
    _check_dim(_dim(out, 1), N, "out.shape[1]")
    return out


# ---- quantize / GEMM -----------------------------------------------------------------

def quantize_rows_q8(x, path="simd"):
    """x float32[M, K] -> (q int8[M, K], d float32[M, K/32]): d = amax/127, q = rint(x * 127/amax)."""
    cdef bint simd = _use_simd(path)
    _check(x, "x", cnp.NPY_FLOAT32, 2, 0, "float32 2-D")
    cdef Py_ssize_t M = _dim(x, 0), K = _dim(x, 1)
    _check_k(K, "x")
    q = _empty(2, M, K, 0, cnp.NPY_INT8)
    d = _empty(2, M, K // QK, 0, cnp.NPY_FLOAT32)
    cdef const float *xp = <const float *>_data(x)
    cdef int8_t *qp = <int8_t *>_data(q)
    cdef float *dp = <float *>_data(d)
    if M == 0:
        return q, d
    with nogil:
        if simd:
            quantize_rows_q8_simd(xp, M, K, qp, dp)
        else:
            quantize_rows_q8_portable(xp, M, K, qp, dp)
    return q, d


cdef object _gemm(bint q4, object wq, object wd, object xq, object xd, object out, object path,
                  int threads):
    cdef bint simd = _use_simd(path)
    cdef int nt = _nthreads(threads)
    if q4:
        _check(wq, "wq", cnp.NPY_UINT8, 2, 0, "uint8 [N, K/2] (Q4_0)")
    else:
        _check(wq, "wq", cnp.NPY_INT8, 2, 0, "int8 [N, K] (Q8_0)")
    _check(wd, "wd", cnp.NPY_FLOAT16, 2, 0, "float16 (or uint16 bits) [N, K/32]")
    _check(xq, "xq", cnp.NPY_INT8, 2, 0, "int8 [M, K]")
    _check(xd, "xd", cnp.NPY_FLOAT32, 2, 0, "float32 [M, K/32]")
    cdef Py_ssize_t N = _dim(wq, 0), K = _dim(xq, 1), M = _dim(xq, 0)
    _check_k(K, "xq")
    _check_dim(_dim(wq, 1), K // 2 if q4 else K, "wq.shape[1]")
    _check_dim(_dim(wd, 0), N, "wd.shape[0]")
    _check_dim(_dim(wd, 1), K // QK, "wd.shape[1]")
    _check_dim(_dim(xd, 0), M, "xd.shape[0]")
    _check_dim(_dim(xd, 1), K // QK, "xd.shape[1]")
    out = _out2(out, M, N)
    cdef const void *w = _data(wq)
    cdef const uint16_t *d = <const uint16_t *>_data(wd)
    cdef const int8_t *x = <const int8_t *>_data(xq)
    cdef const float *xs = <const float *>_data(xd)
    cdef float *y = <float *>_data(out)
    if M == 0 or N == 0:
        return out
    with nogil:
        if q4 and simd:
            gemm_q4_simd(<const uint8_t *>w, d, N, K, x, xs, M, y, nt)
        elif q4:
            gemm_q4_portable(<const uint8_t *>w, d, N, K, x, xs, M, y, nt)
        elif simd:
            gemm_q8_simd(<const int8_t *>w, d, N, K, x, xs, M, y, nt)
        else:
            gemm_q8_portable(<const int8_t *>w, d, N, K, x, xs, M, y, nt)
    return out


def gemm_q8(wq, wd, xq, xd, out=None, path="simd", int threads=0):
    """y float32[M, N]: y[m, n] = sum_b int32(xq[m,b] . wq[n,b]) * xd[m,b] * wd[n,b].

    wq int8[N, K], wd float16[N, K/32] (Q8_0); xq int8[M, K], xd float32[M, K/32].
    """
    return _gemm(0, wq, wd, xq, xd, out, path, threads)


def gemm_q4(wq, wd, xq, xd, out=None, path="simd", int threads=0):
    """As gemm_q8 with Q4_0 weights: wq uint8[N, K/2] (nibbles, see kernels.h), wd float16[N, K/32]."""
    return _gemm(1, wq, wd, xq, xd, out, path, threads)


# ---- elementwise -------------------------------------------------------------------

def rmsnorm(x, w, float eps, out=None, path="simd"):
    """out float32[M, D] = x / sqrt(mean(x^2) + eps) * w; `out` may be `x`."""
    cdef bint simd = _use_simd(path)
    _check(x, "x", cnp.NPY_FLOAT32, 2, 0, "float32 [M, D]")
    _check(w, "w", cnp.NPY_FLOAT32, 1, 0, "float32 [D]")
    cdef Py_ssize_t M = _dim(x, 0), D = _dim(x, 1)
    _check_dim(_dim(w, 0), D, "w.shape[0]")
    out = _out2(out, M, D)
    cdef const float *xp = <const float *>_data(x)
    cdef const float *wp = <const float *>_data(w)
    cdef float *op = <float *>_data(out)
    if M == 0 or D == 0:
        return out
    with nogil:
        if simd:
            rmsnorm_simd(xp, wp, M, D, eps, op)
        else:
            rmsnorm_portable(xp, wp, M, D, eps, op)
    return out


def rope(x, pos, inv_freq, path="simd"):
    """In place, rotate-half: x float32[M, H, hd], pos int32[M], inv_freq float32[hd/2]."""
    cdef bint simd = _use_simd(path)
    _check(x, "x", cnp.NPY_FLOAT32, 3, 1, "float32 [M, H, hd]")
    _check(pos, "pos", cnp.NPY_INT32, 1, 0, "int32 [M]")
    _check(inv_freq, "inv_freq", cnp.NPY_FLOAT32, 1, 0, "float32 [hd/2]")
    cdef Py_ssize_t M = _dim(x, 0), H = _dim(x, 1), hd = _dim(x, 2)
    if hd % 2:
        raise ValueError(f"x: head_dim {hd} must be even")
    _check_dim(_dim(pos, 0), M, "pos.shape[0]")
    _check_dim(_dim(inv_freq, 0), hd // 2, "inv_freq.shape[0]")
    cdef float *xp = <float *>_data(x)
    cdef const int32_t *pp = <const int32_t *>_data(pos)
    cdef const float *fp = <const float *>_data(inv_freq)
    if M == 0 or H == 0 or hd == 0:
        return None
    with nogil:
        if simd:
            rope_simd(xp, M, H, hd, pp, fp)
        else:
            rope_portable(xp, M, H, hd, pp, fp)
    return None


cdef int _check_any(object a, str name, bint writable) except -1:
    """Any-shaped C-contiguous float32 array."""
    if cnp.PyArray_Check(a):
        _check(a, name, cnp.NPY_FLOAT32, cnp.PyArray_NDIM(<cnp.ndarray>a), writable, "float32")
        return 0
    raise ValueError(f"{name}: expected a float32 numpy array, got {_what(a)}")


def silu_mul(gate, up, out=None, path="simd"):
    """out = silu(gate) * up elementwise, any shape (all three alike); `out` may be `gate`."""
    cdef bint simd = _use_simd(path)
    _check_any(gate, "gate", 0)
    _check_any(up, "up", 0)
    if gate.shape != up.shape:
        raise ValueError(f"up has shape {up.shape}, gate has {gate.shape}")
    if out is None:
        out = cnp.PyArray_EMPTY(cnp.PyArray_NDIM(<cnp.ndarray>gate), cnp.PyArray_DIMS(<cnp.ndarray>gate),
                                cnp.NPY_FLOAT32, 0)
    else:
        _check_any(out, "out", 1)
        if out.shape != gate.shape:
            raise ValueError(f"out has shape {out.shape}, gate has {gate.shape}")
    cdef Py_ssize_t n = cnp.PyArray_SIZE(<cnp.ndarray>gate)
    cdef const float *g = <const float *>_data(gate)
    cdef const float *u = <const float *>_data(up)
    cdef float *o = <float *>_data(out)
    if n == 0:
        return out
    with nogil:
        if simd:
            silu_mul_simd(g, u, n, o)
        else:
            silu_mul_portable(g, u, n, o)
    return out


# ---- attention ---------------------------------------------------------------------

cdef enum:
    ATTN_Q8 = 0
    ATTN_Q4 = 1
    ATTN_F32 = 2


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


cdef object _attention(int kind, object q, object k, object ks, object v, object vs, object table,
                       object blockpos, object count, object qpos, float scale, object out,
                       object path, int threads, object importance=None):
    cdef bint simd = _use_simd(path)
    cdef int nt = _nthreads(threads)
    _check(q, "q", cnp.NPY_FLOAT32, 3, 0, "float32 [T, Hq, hd]")
    cdef Py_ssize_t T = _dim(q, 0), Hq = _dim(q, 1), hd = _dim(q, 2)
    if kind == ATTN_Q8:
        _check(k, "k", cnp.NPY_INT8, 4, 0, "int8 [nblk, n_kv, bs, hd]")
        _check(v, "v", cnp.NPY_INT8, 4, 0, "int8 [nblk, n_kv, bs, hd]")
        _check(ks, "ks", cnp.NPY_FLOAT32, 3, 0, "float32 [nblk, n_kv, bs]")
        _check(vs, "vs", cnp.NPY_FLOAT32, 3, 0, "float32 [nblk, n_kv, bs]")
    elif kind == ATTN_Q4:
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
    cdef Py_ssize_t row = hd // 2 if kind == ATTN_Q4 else hd
    for a, name in ((k, "k"), (v, "v")):
        _check_dim(_dim(a, 0), nblk, f"{name}.shape[0]")
        _check_dim(_dim(a, 1), n_kv, f"{name}.shape[1]")
        _check_dim(_dim(a, 2), bs, f"{name}.shape[2]")
        _check_dim(_dim(a, 3), row, f"{name}.shape[3]")
    if kind != ATTN_F32:
        for a, name in ((ks, "ks"), (vs, "vs")):
            _check_dim(_dim(a, 0), nblk, f"{name}.shape[0]")
            _check_dim(_dim(a, 1), n_kv, f"{name}.shape[1]")
            _check_dim(_dim(a, 2), bs, f"{name}.shape[2]")
            if kind == ATTN_Q4:
                _check_dim(_dim(a, 3), hd // QK, f"{name}.shape[3]")

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

    if out is None:
        out = _empty(3, T, Hq, hd, cnp.NPY_FLOAT32)
    else:
        _check(out, "out", cnp.NPY_FLOAT32, 3, 1, "float32 [T, Hq, hd]")
        if out.shape != q.shape:
            raise ValueError(f"out has shape {out.shape}, q has {q.shape}")
    cdef const float *qp = <const float *>_data(q)
    cdef const void *kp = _data(k)
    cdef const void *vp = _data(v)
    cdef const float *ksp = NULL
    cdef const float *vsp = NULL
    if kind != ATTN_F32:
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
        if kind == ATTN_Q8 and simd:
            attention_q8_simd(qp, T, n_kv, group, hd, <const int8_t *>kp, ksp, <const int8_t *>vp, vsp,
                              bs, tp, bp, cp, nsel, stride, qpp, scale, op, nt)
        elif kind == ATTN_Q8:
            attention_q8_portable(qp, T, n_kv, group, hd, <const int8_t *>kp, ksp, <const int8_t *>vp, vsp,
                                  bs, tp, bp, cp, nsel, stride, qpp, scale, op, nt)
        elif kind == ATTN_Q4 and simd:
            attention_q4_simd(qp, T, n_kv, group, hd, <const uint8_t *>kp, ksp, <const uint8_t *>vp, vsp,
                              bs, tp, bp, cp, nsel, stride, qpp, scale, op, nt)
        elif kind == ATTN_Q4:
            attention_q4_portable(qp, T, n_kv, group, hd, <const uint8_t *>kp, ksp, <const uint8_t *>vp, vsp,
                                  bs, tp, bp, cp, nsel, stride, qpp, scale, op, nt)
        elif simd:
            attention_f32_simd(qp, T, n_kv, group, hd, <const float *>kp, <const float *>vp,
                               bs, tp, bp, cp, nsel, stride, qpp, scale, op, nt)
        else:
            attention_f32_portable(qp, T, n_kv, group, hd, <const float *>kp, <const float *>vp,
                                   bs, tp, bp, cp, nsel, stride, qpp, scale, op, nt)
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
    return _attention(ATTN_Q8, q, k, ks, v, vs, table, blockpos, count, qpos, scale, out, path, threads,
                      importance)


def attention_q4(q, k, ks, v, vs, table, blockpos, count, qpos, float scale, out=None,
                 path="simd", int threads=0, importance=None):
    """As attention_q8 over a q4 cache: k, v uint8[nblk, n_kv, bs, hd/2] (Q4_0 nibbles),
    ks, vs float32[nblk, n_kv, bs, hd/32]."""
    return _attention(ATTN_Q4, q, k, ks, v, vs, table, blockpos, count, qpos, scale, out, path, threads,
                      importance)


def attention_f32(q, k, v, table, blockpos, count, qpos, float scale, out=None, path="simd",
                  int threads=0, importance=None):
    """As attention_q8 over an unquantized cache (a debugging probe): k, v float32[nblk, n_kv, bs, hd]."""
    return _attention(ATTN_F32, q, k, None, v, None, table, blockpos, count, qpos, scale, out, path,
                      threads, importance)


cdef int _probe_kind(str kind) except -1:
    if kind == "q8":
        return ATTN_Q8
    if kind == "q4":
        return ATTN_Q4
    if kind == "f32":
        return ATTN_F32
    raise ValueError(f"kind must be q8, q4 or f32, not {kind!r}")


cdef object _check_probe_args(int c_kind, object q, object k, object ks, object table, object count):
    """Validate the arguments both probes share; returns (want dtype pair, R, Hq, hd, nblk, n_kv, bs, nblocks)."""
    _check(q, "q", cnp.NPY_FLOAT32, 3, 0, "float32 [R, Hq, hd]")
    want = {ATTN_Q8: (cnp.NPY_INT8, "int8"), ATTN_Q4: (cnp.NPY_UINT8, "uint8"),
            ATTN_F32: (cnp.NPY_FLOAT32, "float32")}[c_kind]
    _check(k, "k", want[0], 4, 0, f"{want[1]} [nblk, n_kv, bs, row]")
    cdef Py_ssize_t R = _dim(q, 0), Hq = _dim(q, 1), hd = _dim(q, 2)
    cdef Py_ssize_t nblk = _dim(k, 0), n_kv = _dim(k, 1), bs = _dim(k, 2)
    if hd <= 0 or hd % QK:
        raise ValueError(f"q: head_dim {hd} must be a positive multiple of {QK}")
    if n_kv <= 0 or Hq % n_kv:
        raise ValueError(f"q has {Hq} heads, not a multiple of the cache's {n_kv} kv heads")
    _check_dim(_dim(k, 3), hd // 2 if c_kind == ATTN_Q4 else hd, "k.shape[3]")
    if c_kind != ATTN_F32:
        _check(ks, "ks", cnp.NPY_FLOAT32, 3 if c_kind == ATTN_Q8 else 4, 0, "float32 K scales")
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
        if c_kind != ATTN_F32:
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
    if c_kind != ATTN_F32:
        ksp = <const float *>_data(ks)
    if pk is not None:
        pkp = _data(pk)
        if c_kind != ATTN_F32:
            pksp = <const float *>_data(pks)
    cdef float *op = <float *>_data(out)
    cdef const int32_t *tp = <const int32_t *>_data(table)
    cdef const int32_t *cp = <const int32_t *>_data(count)
    cdef int64_t c_R = R, c_nkv = n_kv, c_group = Hq // n_kv, c_hd = hd, c_bs = bs, c_pbs = pbs
    cdef int64_t c_nblocks = nblocks
    cdef int nt = threads
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
    if c_kind != ATTN_F32:
        ksp = <const float *>_data(ks)
    cdef const int8_t *bkp = <const int8_t *>_data(bk)
    cdef const float *bksp = <const float *>_data(bks)
    cdef float *op = <float *>_data(out)
    cdef const int32_t *tp = <const int32_t *>_data(table)
    cdef const int32_t *cp = <const int32_t *>_data(count)
    cdef int64_t c_R = R, c_nkv = n_kv, c_group = Hq // n_kv, c_hd = hd, c_bs = bs
    cdef int64_t c_nblocks = nblocks, c_ncand = ncand
    cdef int nt = threads
    with nogil:
        if simd:
            attention_probe_bound_simd(c_kind, qp, c_R, c_nkv, c_group, c_hd, kp, ksp, c_bs, bkp, bksp, tp, cp,
                                       c_nblocks, c_ncand, scale, op, nt)
        else:
            attention_probe_bound_portable(c_kind, qp, c_R, c_nkv, c_group, c_hd, kp, ksp, c_bs, bkp, bksp, tp,
                                           cp, c_nblocks, c_ncand, scale, op, nt)
    return out


# ---- fp16 helpers (the portable bit manipulation, exposed for tests) -------------------

def fp16_to_fp32(h):
    """uint16[n] (IEEE half bits) -> float32[n]."""
    cdef const uint16_t[::1] hv = h
    res = np.empty(hv.shape[0], dtype=np.float32)
    cdef float[::1] rv = res
    cdef Py_ssize_t i
    for i in range(hv.shape[0]):
        rv[i] = c_fp16_to_fp32(hv[i])
    return res


def fp32_to_fp16(x):
    """float32[n] -> uint16[n] (IEEE half bits, round to nearest even)."""
    cdef const float[::1] xv = x
    res = np.empty(xv.shape[0], dtype=np.uint16)
    cdef uint16_t[::1] rv = res
    cdef Py_ssize_t i
    for i in range(xv.shape[0]):
        rv[i] = c_fp32_to_fp16(xv[i])
    return res
