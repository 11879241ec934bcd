/* Instantiates the dtype-generic kernels of KV_DTYPE_TEMPLATE (a header written with the
   macros ELEM, the storage element type, and SFX, the symbol suffix) once for float32 (symbols
   ending _f32) and once for bfloat16 (_bf16, stored as the top half of a float32). Deliberately
   no include guard: each kernel family includes it once. */
#ifndef KV_DTYPE_TEMPLATE
#error "define KV_DTYPE_TEMPLATE before including kv_instantiate.h"
#endif
#define ELEM float
#define SFX f32
#include KV_DTYPE_TEMPLATE
#undef ELEM
#undef SFX
#define ELEM uint16_t
#define SFX bf16
#include KV_DTYPE_TEMPLATE
#undef ELEM
#undef SFX
#undef KV_DTYPE_TEMPLATE
