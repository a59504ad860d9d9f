/* NEON attention: filled in later. */
#include "../internal.h"
