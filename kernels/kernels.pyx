# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""appliance.kernels._kernels: thin wrappers over the C kernels of kernels/kernels.h, all of them.

Every compute kernel takes `path="simd"` (the build's best path; see kernel_path()) or
`path="portable"` (the plain C reference); the KV cache writes and the block choice have one
plain-C version only (kv.pxi). Each wrapper validates shapes, dtypes and contiguity (a wrong
call raises ValueError, it never reaches C), then releases the GIL for the kernel.
`threads=0` means the module default, set_threads(n); every parallel kernel takes it.
appliance/kernels/reference.py is the numpy twin of this module, function for function.
Integer weights/activations must lie in [-127, 127], which is what appliance.kernels.quant and
quantize_rows_q8 produce (the SIMD dot products rely on it).
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int8_t, uint8_t, uint16_t, int32_t, int64_t, uint64_t

# The contract, declared once in kernels.pxd (explicit: this module is appliance.kernels._kernels,
# so Cython would not pair it with kernels.pxd by name).
from kernels cimport *

cnp.import_array()

cdef int _threads = max(1, kernel_default_threads())


def set_threads(int n):
    """Default thread count of the parallel kernels (threads=0 in a call)."""
    global _threads
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    _threads = n


def get_threads():
    return _threads


_FAMILIES = {"gemm": KERNEL_GEMM, "attention": KERNEL_ATTENTION, "probe": KERNEL_PROBE,
             "probe_bound": KERNEL_PROBE_BOUND}


def last_threads():
    """{family: threads} the last parallel region of each kernel family really ran with (1 when it
    ran on the calling thread because the work was small; 0 before the family first ran)."""
    return {name: kernel_last_threads(f) for name, f in _FAMILIES.items()}


_POOL_STATS = ("jobs", "caller_chunks", "worker_chunks", "caller_sleeps", "worker_wakeups", "taken_back")


def pool_stats():
    """{counter: value} of the kernels' thread pool since the process started: parallel jobs, chunks
    the calling threads and the workers ran, times a caller slept on a chunk a worker held (its core
    was taken), times a worker woke from sleep, and chunks a caller computed again instead of
    waiting for a worker that held them without progress (decode-sized GEMMs)."""
    cdef int64_t out[KERNEL_POOL_STATS]
    kernel_pool_stats(out)
    return {name: out[i] for i, name in enumerate(_POOL_STATS)}


def pool_hold_workers(bint hold):
    """While held, the pool's workers take no work, as when another process holds their cores:
    every kernel still completes, on the calling thread (for tests)."""
    kernel_pool_hold_workers(hold)


def pool_stall_workers(int us):
    """Make every worker sleep `us` microseconds after taking each chunk of a decode-sized GEMM, as
    when it loses its core holding one; the caller lets a worker take the first chunk before it
    starts (for tests; 0: off)."""
    if us < 0:
        raise ValueError(f"stall must be >= 0 microseconds, got {us}")
    kernel_pool_stall_workers(us)


def pool_late_workers(int us):
    """Make every worker wait `us` microseconds after it sees each new job before it looks for
    chunks, and every caller wait twice that between writing a job's descriptor and opening its
    chunks: a worker then meets the next job's count while it still holds the last job's number
    (for tests; 0: off)."""
    if us < 0:
        raise ValueError(f"delay must be >= 0 microseconds, got {us}")
    kernel_pool_late_workers(us)


# Operands of GEMM and decode attention calls that returned with a stalled worker still inside (kernels.h
# kernel_pool_last_stale), by job: held so that the worker never reads freed memory. A dict, whose
# single-key stores and pops are atomic, so that two Python threads never drop each other's.
_stale_operands = {}


cdef inline void _hold_if_stale(object operands):
    cdef uint64_t job = kernel_pool_last_stale()
    if job:
        _stale_operands[job] = operands
    if _stale_operands:
        for held in list(_stale_operands):
            if kernel_pool_released(held):
                _stale_operands.pop(held, None)


def pool_set_spin_us(int us):
    """How long an idle worker spins for the next job before it sleeps (default 200 microseconds)."""
    if us < 0:
        raise ValueError(f"spin must be >= 0 microseconds, got {us}")
    kernel_pool_set_spin_us(us)


def gemm_variant():
    """The micro-kernel prefill-sized GEMMs run: "avx-vnni" | "avx512-vnni" | "avx2" | "sdot", or
    "rows" (the row route alone; every one gives the same bits, kernels.h)."""
    return (<bytes>kernel_gemm_variant()).decode()


def gemm_variants():
    """The GEMM micro-kernels this build and CPU can run (gemm_variant's names)."""
    return (<bytes>kernel_gemm_variants()).decode().split()


def set_gemm_variant(str name):
    """Run prefill-sized GEMMs with another micro-kernel of gemm_variants() (tests, benchmarks)."""
    if kernel_set_gemm_variant(name.encode()) != 0:
        raise ValueError(f"GEMM variant {name!r} is not one this build and CPU run: {', '.join(gemm_variants())}")


def attention_variant():
    """The instantiation path='simd' attention kernels run: "avx512-vnni" | "avx2" on x86, else as
    kernel_path() (every one gives the same bits, kernels.h)."""
    return (<bytes>kernel_attention_variant()).decode()


def attention_variants():
    """The attention instantiations this build and CPU can run (attention_variant's names)."""
    return (<bytes>kernel_attention_variants()).decode().split()


def set_attention_variant(str name):
    """Run the attention kernels' other instantiation of attention_variants() (tests, benchmarks)."""
    if kernel_set_attention_variant(name.encode()) != 0:
        raise ValueError(f"attention variant {name!r} is not one this build and CPU run: "
                         f"{', '.join(attention_variants())}")


def attention_q8_weight_bits(path="simd"):
    """Bits attention_q8's V pass gives a block's softmax weights on `path`: 0 where it multiplies
    in float (x86, portable), 14 on NEON, which sums weight times value as integers. Compare such
    a path with float attention within attention_q8_tolerance(path) of max|V|."""
    return kernel_attention_q8_weight_bits() if _use_simd(path) else 0


def attention_q8_tolerance(path="simd"):
    """How far attention_q8 on `path` may lie from float attention of the same dequantized cache,
    as a fraction of max|V| (kernels.h kernel_attention_tolerance): 2e-5 with float weights
    (float32 scores, exp and sums only); with b-bit weights also their rounding, at most
    2^-(b+1) of a block's largest weight each, which random data sums to about 2^-b of max|V|
    (2.2 * 2^-14 at most in tests/kernels/c/check_simd.c), allowed 8 * 2^-b. The q8 cache itself
    rounds each value to 2^-8 of its row's largest."""
    return kernel_attention_tolerance(attention_q8_weight_bits(path))


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


cdef Py_ssize_t _row_stride(object a, str name, int ndim, str want) except -1:
    """The row stride, in floats, of a float32 array of ndim dimensions whose rows a[i] are each
    C-contiguous (aligned, native order): a C-contiguous array, or a slice of the columns of a
    wider matrix, such as the q, k or v columns of a fused projection's output or one half of
    gate_up. The kernels then read such rows in place, where a copy cost more than the kernel at
    a batch's or a prompt's rows (docs/performance.md)."""
    cdef cnp.ndarray arr
    cdef Py_ssize_t inner = 1, i, stride
    if cnp.PyArray_Check(a):
        arr = <cnp.ndarray>a
        if (cnp.PyArray_TYPE(arr) == cnp.NPY_FLOAT32 and cnp.PyArray_NDIM(arr) == ndim
                and cnp.PyArray_ISBEHAVED_RO(arr)):
            for i in range(ndim - 1, 0, -1):
                if cnp.PyArray_DIMS(arr)[i] != 1 and cnp.PyArray_STRIDES(arr)[i] != inner * 4:
                    break
                inner *= cnp.PyArray_DIMS(arr)[i]
            else:
                stride = cnp.PyArray_STRIDES(arr)[0]
                if cnp.PyArray_DIMS(arr)[0] <= 1:
                    return inner
                if stride % 4 == 0 and stride >= inner * 4:
                    return stride // 4
    raise ValueError(f"{name}: expected a {want} array with C-contiguous rows, got {_what(a)}")


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


cdef object _activation_scales_and_out(xd, Py_ssize_t M, Py_ssize_t K, Py_ssize_t N, out):
    """A GEMM's checks of xd against its M rows of K, then its float32[M, N] result (made if None)."""
    _check_dim(_dim(xd, 0), M, "xd.shape[0]")
    _check_dim(_dim(xd, 1), K // QK, "xd.shape[1]")
    return _out2(out, M, N)


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
    out = _activation_scales_and_out(xd, M, K, N, out)
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
    _hold_if_stale((wq, wd, xq, xd))
    return out


def gemm_q8(wq, wd, xq, xd, out=None, path="simd", int threads=0):
    """y float32[M, N]: y[m, n] = sum_b int32(xq[m,b] . wq[n,b]) * xd[m,b] * wd[n,b].

    wq int8[N, K], wd float16[N, K/32] (Q8_0); xq int8[M, K], xd float32[M, K/32].
    """
    return _gemm(0, wq, wd, xq, xd, out, path, threads)


def gemm_q4(wq, wd, xq, xd, out=None, path="simd", int threads=0):
    """As gemm_q8 with Q4_0 weights: wq uint8[N, K/2] (nibbles, see kernels.h), wd float16[N, K/32]."""
    return _gemm(1, wq, wd, xq, xd, out, path, threads)


# ---- weights in strips (kernels/gemm_strips.h) --------------------------------------

def strips_fast():
    """True when gemm_strips runs a vector micro-kernel on this CPU's active GEMM variant, so that
    packing weights into strips pays (x86: AVX512-VNNI or plain AVX2); False: it would be the scalar twin."""
    return kernel_gemm_strips_fast() != 0


def pack_strips(wq, wd, bint q4):
    """Q8_0 (wq int8[N, K]) or Q4_0 (uint8[N, K/2]) weights with their scales wd float16[N, K/32]
    -> uint8[gemm_strips_bytes] in the strips layout, 64-byte aligned, for gemm_strips."""
    if q4:
        _check(wq, "wq", cnp.NPY_UINT8, 2, 0, "uint8 [N, K/2] (Q4_0)")
    else:
        _check(wq, "wq", cnp.NPY_INT8, 2, 0, "int8 [N, K] (Q8_0)")
    _check(wd, "wd", cnp.NPY_FLOAT16, 2, 0, "float16 (or uint16 bits) [N, K/32]")
    cdef Py_ssize_t N = _dim(wq, 0), K = _dim(wd, 1) * QK
    _check_dim(_dim(wq, 1), K // 2 if q4 else K, "wq.shape[1]")
    _check_dim(_dim(wd, 0), N, "wd.shape[0]")
    cdef int64_t nbytes = gemm_strips_bytes(q4, N, K)
    raw = np.empty(nbytes + 64, np.uint8)
    cdef Py_ssize_t start = (-raw.ctypes.data) % 64
    ws = raw[start:start + nbytes]
    cdef const uint8_t *w = <const uint8_t *>_data(wq)
    cdef const uint16_t *d = <const uint16_t *>_data(wd)
    cdef uint8_t *p = <uint8_t *>_data(ws)
    with nogil:
        gemm_strips_pack(q4, w, d, N, K, p)
    return ws


def gemm_strips(ws, Py_ssize_t N, Py_ssize_t K, bint q4, xq, xd, out=None, path="simd", int threads=0):
    """gemm_q8 (q4: gemm_q4) of weights packed by pack_strips (N rows, K inputs), the same bits."""
    cdef bint simd = _use_simd(path)
    cdef int nt = _nthreads(threads)
    _check(ws, "ws", cnp.NPY_UINT8, 1, 0, "uint8 1-D (pack_strips)")
    _check_k(K, "K")
    _check_dim(_dim(ws, 0), gemm_strips_bytes(q4, N, K), "ws.shape[0]")
    if (<size_t>_data(ws)) % 64:
        raise ValueError("ws: the strips must start 64-byte aligned (as pack_strips returns them)")
    _check(xq, "xq", cnp.NPY_INT8, 2, 0, "int8 [M, K]")
    _check(xd, "xd", cnp.NPY_FLOAT32, 2, 0, "float32 [M, K/32]")
    cdef Py_ssize_t M = _dim(xq, 0)
    _check_dim(_dim(xq, 1), K, "xq.shape[1]")
    out = _activation_scales_and_out(xd, M, K, N, out)
    cdef const uint8_t *w = <const uint8_t *>_data(ws)
    cdef const int8_t *x = <const int8_t *>_data(xq)
    cdef const float *xs = <const float *>_data(xd)
    cdef float *y = <float *>_data(out)
    if M == 0 or N == 0:
        return out
    with nogil:
        if simd:
            gemm_strips_simd(q4, w, N, K, x, xs, M, y, nt)
        else:
            gemm_strips_portable(q4, w, N, K, x, xs, M, y, nt)
    _hold_if_stale((ws, xq, xd))
    return out


# ---- elementwise -------------------------------------------------------------------

def rmsnorm(x, w, float eps, out=None, path="simd"):
    """out = x / sqrt(mean(x^2) + eps) * w over each vector of D: x float32[M, D], or [M, H, D] (a
    head's vector normalized alone, as q_norm and k_norm do), out a new C-contiguous array of
    x's shape (or `out`, which may be `x` when x is C-contiguous). x's rows (x[m]) may be columns
    of a wider matrix: its q or k heads read in place."""
    cdef bint simd = _use_simd(path)
    if not cnp.PyArray_Check(x) or cnp.PyArray_NDIM(<cnp.ndarray>x) not in (2, 3):
        raise ValueError(f"x: expected a float32 [M, D] or [M, H, D] array, got {_what(x)}")
    cdef int nd = cnp.PyArray_NDIM(<cnp.ndarray>x)
    cdef Py_ssize_t ld = _row_stride(x, "x", nd, "float32 [M, D] or [M, H, D]")
    _check(w, "w", cnp.NPY_FLOAT32, 1, 0, "float32 [D]")
    cdef Py_ssize_t M = _dim(x, 0), H = _dim(x, 1) if nd == 3 else 1, D = _dim(x, nd - 1)
    _check_dim(_dim(w, 0), D, "w.shape[0]")
    if out is None:
        out = _empty(nd, M, _dim(x, 1), D, cnp.NPY_FLOAT32)
    else:
        _check(out, "out", cnp.NPY_FLOAT32, nd, 1, "float32 array shaped as x")
        if out.shape != x.shape:
            raise ValueError(f"out has shape {out.shape}, x has {x.shape}")
    cdef const float *xp = <const float *>_data(x)
    cdef const float *wp = <const float *>_data(w)
    cdef float *op = <float *>_data(out)
    cdef Py_ssize_t m
    if M == 0 or H == 0 or D == 0:
        return out
    with nogil:
        if ld == H * D:      # every vector in one call: each is normalized alone, so the bits agree
            if simd:
                rmsnorm_simd(xp, wp, M * H, D, eps, op)
            else:
                rmsnorm_portable(xp, wp, M * H, D, eps, op)
        else:
            for m in range(M):
                if simd:
                    rmsnorm_simd(xp + m * ld, wp, H, D, eps, op + m * H * D)
                else:
                    rmsnorm_portable(xp + m * ld, wp, H, D, eps, op + m * H * D)
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


cdef object _out_any(object out, object like, str like_name):
    """out for an elementwise kernel: a new float32 array shaped as `like`, or `out` checked."""
    if out is None:
        return cnp.PyArray_EMPTY(cnp.PyArray_NDIM(<cnp.ndarray>like), cnp.PyArray_DIMS(<cnp.ndarray>like),
                                 cnp.NPY_FLOAT32, 0)
    _check_any(out, "out", 1)
    if out.shape != like.shape:
        raise ValueError(f"out has shape {out.shape}, {like_name} has {like.shape}")
    return out


def silu_mul(gate, up, out=None, path="simd"):
    """out = silu(gate) * up elementwise, any shape (all three alike); `out` may be `gate`. gate and
    up may also be [M, F] arrays whose rows are columns of a wider matrix (the two halves of a
    fused gate_up), read in place; out is then a new C-contiguous [M, F] array (or `out`)."""
    cdef bint simd = _use_simd(path)
    if (cnp.PyArray_Check(gate) and cnp.PyArray_Check(up) and cnp.PyArray_NDIM(<cnp.ndarray>gate) == 2
            and not (cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>gate) and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>up))):
        return _silu_mul_rows(gate, up, out, simd)
    _check_any(gate, "gate", 0)
    _check_any(up, "up", 0)
    if gate.shape != up.shape:
        raise ValueError(f"up has shape {up.shape}, gate has {gate.shape}")
    out = _out_any(out, gate, "gate")
    _silu_mul_run(gate, 0, up, 0, out, 1, cnp.PyArray_SIZE(<cnp.ndarray>gate), simd)
    return out


cdef object _silu_mul_rows(gate, up, out, bint simd):
    """silu_mul on [M, F] operands with strided rows, a row a call (elementwise: the same bits)."""
    cdef Py_ssize_t lg = _row_stride(gate, "gate", 2, "float32 [M, F]")
    cdef Py_ssize_t lu = _row_stride(up, "up", 2, "float32 [M, F]")
    if gate.shape != up.shape:
        raise ValueError(f"up has shape {up.shape}, gate has {gate.shape}")
    cdef Py_ssize_t M = _dim(gate, 0), F = _dim(gate, 1)
    out = _out2(out, M, F)
    _silu_mul_run(gate, lg, up, lu, out, M, F, simd)
    return out


cdef void _silu_mul_run(gate, Py_ssize_t lg, up, Py_ssize_t lu, out, Py_ssize_t M, Py_ssize_t F, bint simd):
    """M rows of F: row m of gate at m * lg, of up at m * lu, of out (C-contiguous) at m * F."""
    cdef const float *g = <const float *>_data(gate)
    cdef const float *u = <const float *>_data(up)
    cdef float *o = <float *>_data(out)
    cdef Py_ssize_t m
    if F == 0:
        return
    with nogil:
        for m in range(M):
            if simd:
                silu_mul_simd(g + m * lg, u + m * lu, F, o + m * F)
            else:
                silu_mul_portable(g + m * lg, u + m * lu, F, o + m * F)


def layer_norm(x, w, b, float eps, out=None, path="simd"):
    """out float32[M, D] = (x - mean) / sqrt(var + eps) * w + b over each row; `out` may be `x`."""
    cdef bint simd = _use_simd(path)
    _check(x, "x", cnp.NPY_FLOAT32, 2, 0, "float32 [M, D]")
    _check(w, "w", cnp.NPY_FLOAT32, 1, 0, "float32 [D]")
    _check(b, "b", cnp.NPY_FLOAT32, 1, 0, "float32 [D]")
    cdef Py_ssize_t M = _dim(x, 0), D = _dim(x, 1)
    _check_dim(_dim(w, 0), D, "w.shape[0]")
    _check_dim(_dim(b, 0), D, "b.shape[0]")
    out = _out2(out, M, D)
    cdef const float *xp = <const float *>_data(x)
    cdef const float *wp = <const float *>_data(w)
    cdef const float *bp = <const float *>_data(b)
    cdef float *op = <float *>_data(out)
    if M == 0 or D == 0:
        return out
    with nogil:
        if simd:
            layer_norm_simd(xp, wp, bp, M, D, eps, op)
        else:
            layer_norm_portable(xp, wp, bp, M, D, eps, op)
    return out


def gelu_tanh(x, out=None, path="simd"):
    """out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) elementwise, any shape; `out` may be `x`."""
    cdef bint simd = _use_simd(path)
    _check_any(x, "x", 0)
    out = _out_any(out, x, "x")
    cdef Py_ssize_t n = cnp.PyArray_SIZE(<cnp.ndarray>x)
    cdef const float *xp = <const float *>_data(x)
    cdef float *op = <float *>_data(out)
    if n == 0:
        return out
    with nogil:
        if simd:
            gelu_tanh_simd(xp, n, op)
        else:
            gelu_tanh_portable(xp, n, op)
    return out


include "attention.pxi"
include "kv.pxi"


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
