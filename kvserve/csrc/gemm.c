#include "kv_vec.h"
#include <omp.h>

#define KV_DTYPE_TEMPLATE "gemm_dtype.h"
#include "kv_instantiate.h"
