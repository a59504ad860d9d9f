/*
 * The AVX-512 (with VNNI) instantiation of the x86 attention primitives (attention_x86.h,
 * attention_avx512.h): Skylake-X class CPUs with VNNI (Cascade Lake, Ice Lake, Sapphire Rapids)
 * and Zen 4 on. x86/avx2_attention.c runs it where the CPU has those extensions.
 */
#include "../internal.h"

#if defined(KERNELS_AVX2)
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni")
#define ATTN_X86_AVX512 1
#define ATTN_NAME(x) x##_avx512
#include "attention_x86.h"
#endif /* KERNELS_AVX2 */
