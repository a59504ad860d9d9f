/* AVX2 path: filled in next. */
#include "../internal.h"
