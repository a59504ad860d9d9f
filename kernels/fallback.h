/*
 * Which SIMD path this build compiles, decided once from the compiler's target macros.
 * The path files (x86/avx2.c, arm/neon.c) compile to nothing unless their macro is set;
 * dispatch.c maps every *_simd to its *_portable twin when none is.
 */
#ifndef APPLIANCE_FALLBACK_H
#define APPLIANCE_FALLBACK_H

/* The AVX2 and NEON paths are not in yet: every build is portable for now. */

#if defined(KERNELS_AVX2) || defined(KERNELS_NEON)
#  define KERNELS_HAVE_SIMD 1
#endif

#endif
