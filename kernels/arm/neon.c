/* NEON path: filled in later. */
#include "../internal.h"
