"""Keep llama.cpp off Intel AMX in this process (x86_64 Linux).

llama-cpp-python built with -DGGML_NATIVE=ON on a CPU that has AMX compiles ggml's AMX
backend, which crashed here with SIGSEGV (a #GP on `ldtilecfg` in
ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36) at the first batched matmul. ggml
enables that backend only if the kernel grants the process AMX tile data
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); a seccomp filter that answers
that one call with EPERM makes ggml print "AMX is not ready to be used!" and use its
ordinary AVX-512/AVX2 kernels (and its repack buffers), as on a CPU without AMX. The
board this engine targets is ARM: it has no AMX either.

Call deny_amx() before llama_cpp loads a model; it affects this process and its children.
"""
from __future__ import annotations

import ctypes
import platform
import struct
import sys

_NR_ARCH_PRCTL_X86_64 = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_AUDIT_ARCH_X86_64 = 0xC000003E
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO_EPERM = 0x00050000 | 1
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_RET_K = 0x20, 0x15, 0x06


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)   # struct sock_filter


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def deny_amx() -> str:
    """Install the filter if this is x86_64 Linux with AMX; a word on what was done."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "not x86_64 Linux: nothing to do"
    if not cpu_has_amx():
        return "CPU has no AMX"
    prog = b"".join([
        _insn(_BPF_LD_W_ABS, 4),                                    # seccomp_data.arch
        _insn(_BPF_JEQ_K, _AUDIT_ARCH_X86_64, 0, 4),
        _insn(_BPF_LD_W_ABS, 0),                                    # seccomp_data.nr
        _insn(_BPF_JEQ_K, _NR_ARCH_PRCTL_X86_64, 0, 2),
        _insn(_BPF_LD_W_ABS, 16),                                   # args[0], low 32 bits
        _insn(_BPF_JEQ_K, _ARCH_REQ_XCOMP_PERM, 1, 0),
        _insn(_BPF_RET_K, _SECCOMP_RET_ALLOW),
        _insn(_BPF_RET_K, _SECCOMP_RET_ERRNO_EPERM),
    ])
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"could not set no_new_privs (errno {ctypes.get_errno()}): AMX left on"
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        return f"could not install the seccomp filter (errno {ctypes.get_errno()}): AMX left on"
    if libc.syscall(_NR_ARCH_PRCTL_X86_64, _ARCH_REQ_XCOMP_PERM, 18) != -1:
        return "filter installed but AMX permission still granted"
    return "AMX denied (seccomp on arch_prctl ARCH_REQ_XCOMP_PERM)"
