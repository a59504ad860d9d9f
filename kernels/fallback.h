/*
 * Which SIMD path this build compiles, decided once from the compiler's target macros.
 * The path files (x86/avx2.c, arm/neon.c) compile to nothing unless their macro is set;
 * dispatch.c maps every *_simd to its *_portable twin when none is.
 */
#ifndef APPLIANCE_FALLBACK_H
#define APPLIANCE_FALLBACK_H

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#  define KERNELS_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#  define KERNELS_NEON 1
#  if defined(__ARM_FEATURE_DOTPROD)
#    define KERNELS_NEON_DOTPROD 1
#  endif
#endif

#if defined(KERNELS_AVX2) || defined(KERNELS_NEON)
#  define KERNELS_HAVE_SIMD 1
#endif

#endif
