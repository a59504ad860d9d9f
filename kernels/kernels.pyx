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
    return f"{type(a).__name__}"


cdef _bad(str name, str want, object a, object err):
    return ValueError(f"{name}: expected a C-contiguous {want} array, got {_what(a)} ({err})")


cdef const float[::1] _f32_1d(object a, str name) except *:
    try:
        return a
    except (TypeError, ValueError) as e:
        raise _bad(name, "float32 1-D", a, e) from None


cdef const float[:, ::1] _f32_2d(object a, str name) except *:
    try:
        return a
    except (TypeError, ValueError) as e:
        raise _bad(name, "float32 2-D", a, e) from None


cdef const float[:, :, ::1] _f32_3d(object a, str name) except *:
    try:
        return a
    except (TypeError, ValueError) as e:
        raise _bad(name, "float32 3-D", a, e) from None


cdef const float[:, :, :, ::1] _f32_4d(object a, str name) except *:
    try:
        return a
    except (TypeError, ValueError) as e:
        raise _bad(name, "float32 4-D", a, e) from None


cdef float[:, ::1] _f32_2d_out(object a, str name) except *:
    try:
        return a
    except (TypeError, ValueError) as e:
        raise _bad(name, "writable float32 2-D", a, e) from None


cdef float[:, :, ::1] _f32_3d_out(object a, str name) except *:
    try:
        return a
    except (TypeError, ValueError) as e:
        raise _bad(name, "writable float32 3-D", a, e) from None


cdef const int8_t[:, ::1] _i8_2d(object a, str name) except *:
    try:
        return a
    except (TypeError, ValueError) as e:
        raise _bad(name, "int8 2-D", a, e) from None


cdef const int8_t[:, :, :, ::1] _i8_4d(object a, str name) except *:
    try:
        return a
    except (TypeError, ValueError) as e:
        raise _bad(name, "int8 4-D", a, e) from None


cdef const uint8_t[:, ::1] _u8_2d(object a, str name) except *:
    try:
        return a
    except (TypeError, ValueError) as e:
        raise _bad(name, "uint8 2-D", a, e) from None


cdef const uint8_t[:, :, :, ::1] _u8_4d(object a, str name) except *:
    try:
        return a
    except (TypeError, ValueError) as e:
        raise _bad(name, "uint8 4-D", a, e) from None


cdef const int32_t[::1] _i32_1d(object a, str name) except *:
    try:
        return a
    except (TypeError, ValueError) as e:
        raise _bad(name, "int32 1-D", a, e) from None


cdef const uint16_t[:, ::1] _half_2d(object a, str name) except *:
    # float16 has no C type here: its bits go to C as uint16 (kernels.h says so).
    if cnp.PyArray_Check(a) and cnp.PyArray_TYPE(<cnp.ndarray>a) == cnp.NPY_FLOAT16:
        a = (<cnp.ndarray>a).view(np.uint16)
    try:
        return a
    except (TypeError, ValueError) as e:
        raise _bad(name, "float16 (or uint16 bits) 2-D", a, e) from None


cdef float *_f32_flat(object a, str name, bint writable, Py_ssize_t *size) except NULL:
    """Any-shaped C-contiguous float32 array -> its data pointer and element count."""
    cdef cnp.ndarray arr
    if not cnp.PyArray_Check(a):
        raise ValueError(f"{name}: expected a float32 numpy array, got {_what(a)}")
    arr = <cnp.ndarray>a
    if (cnp.PyArray_TYPE(arr) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(arr)
            or not cnp.PyArray_ISALIGNED(arr) or (writable and not cnp.PyArray_ISWRITEABLE(arr))):
        want = "writable float32" if writable else "float32"
        raise ValueError(f"{name}: expected a C-contiguous aligned {want} array, got {_what(a)}")
    size[0] = cnp.PyArray_SIZE(arr)
    return <float *>cnp.PyArray_DATA(arr)


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


# ---- quantize / GEMM -----------------------------------------------------------------

def quantize_rows_q8(x, path="simd"):
    """x float32[M, K] -> (q int8[M, K], d float32[M, K/32]): d = amax/127, q = rint(x * 127/amax)."""
    cdef bint simd = _use_simd(path)
    cdef const float[:, ::1] xv = _f32_2d(x, "x")
    cdef Py_ssize_t M = xv.shape[0], K = xv.shape[1]
    _check_k(K, "x")
    q = _empty(2, M, K, 0, cnp.NPY_INT8)
    d = _empty(2, M, K // QK, 0, cnp.NPY_FLOAT32)
    if M == 0:
        return q, d
    cdef int8_t[:, ::1] qv = q
    cdef float[:, ::1] dv = d
    with nogil:
        if simd:
            quantize_rows_q8_simd(&xv[0, 0], M, K, &qv[0, 0], &dv[0, 0])
        else:
            quantize_rows_q8_portable(&xv[0, 0], M, K, &qv[0, 0], &dv[0, 0])
    return q, d


cdef int _check_gemm(Py_ssize_t N, Py_ssize_t K, Py_ssize_t wq_cols, Py_ssize_t wq_cols_want,
                     const uint16_t[:, ::1] d, const int8_t[:, ::1] x, const float[:, ::1] xs,
                     ) except -1:
    _check_k(K, "xq")
    _check_dim(wq_cols, wq_cols_want, "wq.shape[1]")
    _check_dim(d.shape[0], N, "wd.shape[0]")
    _check_dim(d.shape[1], K // QK, "wd.shape[1]")
    _check_dim(xs.shape[0], x.shape[0], "xd.shape[0]")
    _check_dim(xs.shape[1], K // QK, "xd.shape[1]")
    return 0


cdef object _gemm_out(object out, Py_ssize_t M, Py_ssize_t N):
    if out is None:
        return _empty(2, M, N, 0, cnp.NPY_FLOAT32)
    return out


def gemm_q8(wq, wd, xq, xd, out=None, path="simd", int threads=0):
    """y float32[M, N]: y[m, n] = sum_b int32(xq[m,b] . wq[n,b]) * xd[m,b] * wd[n,b].

    wq int8[N, K], wd float16[N, K/32] (Q8_0); xq int8[M, K], xd float32[M, K/32].
    """
    cdef bint simd = _use_simd(path)
    cdef int nt = _nthreads(threads)
    cdef const int8_t[:, ::1] w = _i8_2d(wq, "wq")
    cdef const uint16_t[:, ::1] d = _half_2d(wd, "wd")
    cdef const int8_t[:, ::1] x = _i8_2d(xq, "xq")
    cdef const float[:, ::1] xs = _f32_2d(xd, "xd")
    cdef Py_ssize_t N = w.shape[0], K = x.shape[1], M = x.shape[0]
    _check_gemm(N, K, w.shape[1], K, d, x, xs)
    out = _gemm_out(out, M, N)
    cdef float[:, ::1] y = _f32_2d_out(out, "out")
    _check_dim(y.shape[0], M, "out.shape[0]")
    _check_dim(y.shape[1], N, "out.shape[1]")
    if M == 0 or N == 0:
        return out
    with nogil:
        if simd:
            gemm_q8_simd(&w[0, 0], &d[0, 0], N, K, &x[0, 0], &xs[0, 0], M, &y[0, 0], nt)
        else:
            gemm_q8_portable(&w[0, 0], &d[0, 0], N, K, &x[0, 0], &xs[0, 0], M, &y[0, 0], nt)
    return out


def gemm_q4(wq, wd, xq, xd, out=None, path="simd", int threads=0):
    """As gemm_q8 with Q4_0 weights: wq uint8[N, K/2] (nibbles, see kernels.h), wd float16[N, K/32]."""
    cdef bint simd = _use_simd(path)
    cdef int nt = _nthreads(threads)
    cdef const uint8_t[:, ::1] w = _u8_2d(wq, "wq")
    cdef const uint16_t[:, ::1] d = _half_2d(wd, "wd")
    cdef const int8_t[:, ::1] x = _i8_2d(xq, "xq")
    cdef const float[:, ::1] xs = _f32_2d(xd, "xd")
    cdef Py_ssize_t N = w.shape[0], K = x.shape[1], M = x.shape[0]
    _check_gemm(N, K, w.shape[1], K // 2, d, x, xs)
    out = _gemm_out(out, M, N)
    cdef float[:, ::1] y = _f32_2d_out(out, "out")
    _check_dim(y.shape[0], M, "out.shape[0]")
    _check_dim(y.shape[1], N, "out.shape[1]")
    if M == 0 or N == 0:
        return out
    with nogil:
        if simd:
            gemm_q4_simd(&w[0, 0], &d[0, 0], N, K, &x[0, 0], &xs[0, 0], M, &y[0, 0], nt)
        else:
            gemm_q4_portable(&w[0, 0], &d[0, 0], N, K, &x[0, 0], &xs[0, 0], M, &y[0, 0], nt)
    return out


# ---- elementwise -------------------------------------------------------------------

def rmsnorm(x, w, float eps, out=None, path="simd"):
    """out float32[M, D] = x / sqrt(mean(x^2) + eps) * w; `out` may be `x`."""
    cdef bint simd = _use_simd(path)
    cdef const float[:, ::1] xv = _f32_2d(x, "x")
    cdef const float[::1] wv = _f32_1d(w, "w")
    cdef Py_ssize_t M = xv.shape[0], D = xv.shape[1]
    _check_dim(wv.shape[0], D, "w.shape[0]")
    if out is None:
        out = _empty(2, M, D, 0, cnp.NPY_FLOAT32)
    cdef float[:, ::1] ov = _f32_2d_out(out, "out")
    _check_dim(ov.shape[0], M, "out.shape[0]")
    _check_dim(ov.shape[1], D, "out.shape[1]")
    if M == 0 or D == 0:
        return out
    with nogil:
        if simd:
            rmsnorm_simd(&xv[0, 0], &wv[0], M, D, eps, &ov[0, 0])
        else:
            rmsnorm_portable(&xv[0, 0], &wv[0], M, D, eps, &ov[0, 0])
    return out


def rope(x, pos, inv_freq, path="simd"):
    """In place, rotate-half: x float32[M, H, hd], pos int32[M], inv_freq float32[hd/2]."""
    cdef bint simd = _use_simd(path)
    cdef float[:, :, ::1] xv = _f32_3d_out(x, "x")
    cdef const int32_t[::1] pv = _i32_1d(pos, "pos")
    cdef const float[::1] fv = _f32_1d(inv_freq, "inv_freq")
    cdef Py_ssize_t M = xv.shape[0], H = xv.shape[1], hd = xv.shape[2]
    if hd % 2:
        raise ValueError(f"x: head_dim {hd} must be even")
    _check_dim(pv.shape[0], M, "pos.shape[0]")
    _check_dim(fv.shape[0], hd // 2, "inv_freq.shape[0]")
    if M == 0 or H == 0 or hd == 0:
        return None
    with nogil:
        if simd:
            rope_simd(&xv[0, 0, 0], M, H, hd, &pv[0], &fv[0])
        else:
            rope_portable(&xv[0, 0, 0], M, H, hd, &pv[0], &fv[0])
    return None


def silu_mul(gate, up, out=None, path="simd"):
    """out = silu(gate) * up elementwise, any shape (all three alike); `out` may be `gate`."""
    cdef bint simd = _use_simd(path)
    cdef Py_ssize_t n, n_up, n_out
    cdef const float *g = _f32_flat(gate, "gate", 0, &n)
    cdef const float *u = _f32_flat(up, "up", 0, &n_up)
    if gate.shape != up.shape:
        raise ValueError(f"up has shape {up.shape}, gate has {gate.shape}")
    if out is None:
        out = cnp.PyArray_EMPTY(cnp.PyArray_NDIM(<cnp.ndarray>gate), cnp.PyArray_DIMS(<cnp.ndarray>gate),
                                cnp.NPY_FLOAT32, 0)
    cdef float *o = _f32_flat(out, "out", 1, &n_out)
    if out.shape != gate.shape:
        raise ValueError(f"out has shape {out.shape}, gate has {gate.shape}")
    if n == 0:
        return out
    with nogil:
        if simd:
            silu_mul_simd(g, u, n, o)
        else:
            silu_mul_portable(g, u, n, o)
    return out


# ---- attention ---------------------------------------------------------------------

cdef class _Tables:
    """Validated block lists of one attention call (table/blockpos/count alike, qpos)."""
    cdef const int32_t[::1] table, blockpos, count, qpos
    cdef Py_ssize_t nsel, stride


cdef const int32_t[::1] _i32_table(object a, str name, Py_ssize_t n_kv, Py_ssize_t *nsel,
                                    Py_ssize_t *stride) except *:
    if not isinstance(a, np.ndarray) or a.ndim not in (1, 2):
        raise ValueError(f"{name}: expected an int32 array [nsel] or [n_kv, nsel], got {_what(a)}")
    if a.ndim == 2:
        if a.shape[0] != n_kv:
            raise ValueError(f"{name}: per-head table has {a.shape[0]} rows, expected n_kv = {n_kv}")
        nsel[0] = a.shape[1]
        stride[0] = a.shape[1]
        if not a.flags.c_contiguous:
            raise _bad(name, "int32 2-D", a, "not C-contiguous")
        a = a.reshape(-1)
    else:
        nsel[0] = a.shape[0]
        stride[0] = 0
    return _i32_1d(a, name)


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


cdef _Tables _tables(object table, object blockpos, object count, object qpos,
                     Py_ssize_t n_kv, Py_ssize_t nblk, Py_ssize_t bs, Py_ssize_t T):
    cdef _Tables tb = _Tables.__new__(_Tables)
    cdef Py_ssize_t nsel2, stride2
    tb.table = _i32_table(table, "table", n_kv, &tb.nsel, &tb.stride)
    tb.blockpos = _i32_table(blockpos, "blockpos", n_kv, &nsel2, &stride2)
    if nsel2 != tb.nsel or stride2 != tb.stride:
        raise ValueError(f"blockpos has shape {blockpos.shape}, table has {table.shape}")
    tb.count = _i32_table(count, "count", n_kv, &nsel2, &stride2)
    if nsel2 != tb.nsel or stride2 != tb.stride:
        raise ValueError(f"count has shape {count.shape}, table has {table.shape}")
    tb.qpos = _i32_1d(qpos, "qpos")
    _check_dim(tb.qpos.shape[0], T, "qpos.shape[0]")
    if tb.table.shape[0] > 0:
        _check_tables(&tb.table[0], &tb.blockpos[0], &tb.count[0], tb.table.shape[0], nblk, bs)
    return tb


cdef int _check_attn(const float[:, :, ::1] qv, Py_ssize_t nblk, Py_ssize_t n_kv, Py_ssize_t bs,
                     Py_ssize_t *group) except -1:
    cdef Py_ssize_t hd = qv.shape[2]
    if hd <= 0 or hd % QK:
        raise ValueError(f"q: head_dim {hd} must be a positive multiple of {QK}")
    if n_kv <= 0 or qv.shape[1] % n_kv:
        raise ValueError(f"q has {qv.shape[1]} heads, not a multiple of the cache's {n_kv} kv heads")
    if bs <= 0:
        raise ValueError(f"cache block size must be positive, got {bs}")
    group[0] = qv.shape[1] // n_kv
    return 0


cdef object _attn_out(object out, const float[:, :, ::1] qv):
    if out is None:
        return _empty(3, qv.shape[0], qv.shape[1], qv.shape[2], cnp.NPY_FLOAT32)
    return out


cdef int _check_same4(object a, object b, str na, str nb) except -1:
    if a != b:
        raise ValueError(f"{na} has shape {a}, {nb} has {b}")
    return 0


def attention_q8(q, k, ks, v, vs, table, blockpos, count, qpos, float scale, out=None,
                 path="simd", int threads=0):
    """One-pass attention over a q8 paged cache (see kernels.h for the block-list semantics).

    q float32[T, Hq, hd]; k, v int8[nblk, n_kv, bs, hd]; ks, vs float32[nblk, n_kv, bs];
    table/blockpos/count int32[nsel] (shared by all heads) or int32[n_kv, nsel] (per head);
    qpos int32[T]. Returns float32[T, Hq, hd]; a query that sees no row gets zeros.
    """
    cdef bint simd = _use_simd(path)
    cdef int nt = _nthreads(threads)
    cdef const float[:, :, ::1] qv = _f32_3d(q, "q")
    cdef const int8_t[:, :, :, ::1] kv = _i8_4d(k, "k")
    cdef const int8_t[:, :, :, ::1] vv = _i8_4d(v, "v")
    cdef const float[:, :, ::1] ksv = _f32_3d(ks, "ks")
    cdef const float[:, :, ::1] vsv = _f32_3d(vs, "vs")
    cdef Py_ssize_t T = qv.shape[0], hd = qv.shape[2]
    cdef Py_ssize_t nblk = kv.shape[0], n_kv = kv.shape[1], bs = kv.shape[2], group
    _check_attn(qv, nblk, n_kv, bs, &group)
    _check_same4(k.shape, (nblk, n_kv, bs, hd), "k", "[nblk, n_kv, bs, hd]")
    _check_same4(v.shape, (nblk, n_kv, bs, hd), "v", "k")
    _check_same4(ks.shape, (nblk, n_kv, bs), "ks", "[nblk, n_kv, bs]")
    _check_same4(vs.shape, (nblk, n_kv, bs), "vs", "[nblk, n_kv, bs]")
    cdef _Tables tb = _tables(table, blockpos, count, qpos, n_kv, nblk, bs, T)
    out = _attn_out(out, qv)
    cdef float[:, :, ::1] ov = _f32_3d_out(out, "out")
    _check_same4(out.shape, q.shape, "out", "q")
    if T == 0 or nblk == 0 or tb.nsel == 0:
        ov[...] = 0.0
        return out
    with nogil:
        if simd:
            attention_q8_simd(&qv[0, 0, 0], T, n_kv, group, hd, &kv[0, 0, 0, 0], &ksv[0, 0, 0],
                                        &vv[0, 0, 0, 0], &vsv[0, 0, 0], bs, &tb.table[0], &tb.blockpos[0],
                                        &tb.count[0], tb.nsel, tb.stride, &tb.qpos[0], scale,
                                        &ov[0, 0, 0], nt)
        else:
            attention_q8_portable(&qv[0, 0, 0], T, n_kv, group, hd, &kv[0, 0, 0, 0], &ksv[0, 0, 0],
                                            &vv[0, 0, 0, 0], &vsv[0, 0, 0], bs, &tb.table[0], &tb.blockpos[0],
                                            &tb.count[0], tb.nsel, tb.stride, &tb.qpos[0], scale,
                                            &ov[0, 0, 0], nt)
    return out


def attention_q4(q, k, ks, v, vs, table, blockpos, count, qpos, float scale, out=None,
                 path="simd", int threads=0):
    """As attention_q8 over a q4 cache: k, v uint8[nblk, n_kv, bs, hd/2] (Q4_0 nibbles),
    ks, vs float32[nblk, n_kv, bs, hd/32]."""
    cdef bint simd = _use_simd(path)
    cdef int nt = _nthreads(threads)
    cdef const float[:, :, ::1] qv = _f32_3d(q, "q")
    cdef const uint8_t[:, :, :, ::1] kv = _u8_4d(k, "k")
    cdef const uint8_t[:, :, :, ::1] vv = _u8_4d(v, "v")
    cdef const float[:, :, :, ::1] ksv = _f32_4d(ks, "ks")
    cdef const float[:, :, :, ::1] vsv = _f32_4d(vs, "vs")
    cdef Py_ssize_t T = qv.shape[0], hd = qv.shape[2]
    cdef Py_ssize_t nblk = kv.shape[0], n_kv = kv.shape[1], bs = kv.shape[2], group
    _check_attn(qv, nblk, n_kv, bs, &group)
    _check_same4(k.shape, (nblk, n_kv, bs, hd // 2), "k", "[nblk, n_kv, bs, hd/2]")
    _check_same4(v.shape, (nblk, n_kv, bs, hd // 2), "v", "k")
    _check_same4(ks.shape, (nblk, n_kv, bs, hd // QK), "ks", "[nblk, n_kv, bs, hd/32]")
    _check_same4(vs.shape, (nblk, n_kv, bs, hd // QK), "vs", "[nblk, n_kv, bs, hd/32]")
    cdef _Tables tb = _tables(table, blockpos, count, qpos, n_kv, nblk, bs, T)
    out = _attn_out(out, qv)
    cdef float[:, :, ::1] ov = _f32_3d_out(out, "out")
    _check_same4(out.shape, q.shape, "out", "q")
    if T == 0 or nblk == 0 or tb.nsel == 0:
        ov[...] = 0.0
        return out
    with nogil:
        if simd:
            attention_q4_simd(&qv[0, 0, 0], T, n_kv, group, hd, &kv[0, 0, 0, 0], &ksv[0, 0, 0, 0],
                                        &vv[0, 0, 0, 0], &vsv[0, 0, 0, 0], bs, &tb.table[0], &tb.blockpos[0],
                                        &tb.count[0], tb.nsel, tb.stride, &tb.qpos[0], scale,
                                        &ov[0, 0, 0], nt)
        else:
            attention_q4_portable(&qv[0, 0, 0], T, n_kv, group, hd, &kv[0, 0, 0, 0], &ksv[0, 0, 0, 0],
                                            &vv[0, 0, 0, 0], &vsv[0, 0, 0, 0], bs, &tb.table[0], &tb.blockpos[0],
                                            &tb.count[0], tb.nsel, tb.stride, &tb.qpos[0], scale,
                                            &ov[0, 0, 0], nt)
    return out


def attention_f32(q, k, v, table, blockpos, count, qpos, float scale, out=None, path="simd",
                  int threads=0):
    """As attention_q8 over an unquantized cache (a debugging probe): k, v float32[nblk, n_kv, bs, hd]."""
    cdef bint simd = _use_simd(path)
    cdef int nt = _nthreads(threads)
    cdef const float[:, :, ::1] qv = _f32_3d(q, "q")
    cdef const float[:, :, :, ::1] kv = _f32_4d(k, "k")
    cdef const float[:, :, :, ::1] vv = _f32_4d(v, "v")
    cdef Py_ssize_t T = qv.shape[0], hd = qv.shape[2]
    cdef Py_ssize_t nblk = kv.shape[0], n_kv = kv.shape[1], bs = kv.shape[2], group
    _check_attn(qv, nblk, n_kv, bs, &group)
    _check_same4(k.shape, (nblk, n_kv, bs, hd), "k", "[nblk, n_kv, bs, hd]")
    _check_same4(v.shape, (nblk, n_kv, bs, hd), "v", "k")
    cdef _Tables tb = _tables(table, blockpos, count, qpos, n_kv, nblk, bs, T)
    out = _attn_out(out, qv)
    cdef float[:, :, ::1] ov = _f32_3d_out(out, "out")
    _check_same4(out.shape, q.shape, "out", "q")
    if T == 0 or nblk == 0 or tb.nsel == 0:
        ov[...] = 0.0
        return out
    with nogil:
        if simd:
            attention_f32_simd(&qv[0, 0, 0], T, n_kv, group, hd, &kv[0, 0, 0, 0], &vv[0, 0, 0, 0],
                                         bs, &tb.table[0], &tb.blockpos[0], &tb.count[0], tb.nsel,
                                         tb.stride, &tb.qpos[0], scale, &ov[0, 0, 0], nt)
        else:
            attention_f32_portable(&qv[0, 0, 0], T, n_kv, group, hd, &kv[0, 0, 0, 0],
                                             &vv[0, 0, 0, 0], bs, &tb.table[0], &tb.blockpos[0],
                                             &tb.count[0], tb.nsel, tb.stride, &tb.qpos[0], scale,
                                             &ov[0, 0, 0], nt)
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
