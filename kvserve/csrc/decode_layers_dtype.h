/* The dtype-generic step of decode_layers.c, written with ELEM (storage type) and SFX (symbol
   suffix): included once per dtype through kv_instantiate.h, hence no include guard. The
   function pointer types are the kernels' own prototypes (ops_dtype.h, decode_attention_dtype.h,
   gemm_dtype.h, quant_gemm_dtype.h, amx_gemm.c). */
typedef void (*CAT(dl_rms_, SFX))(const ELEM*, ELEM*, const ELEM*, ELEM*, int64_t, int64_t, float, int);
typedef void (*CAT(dl_rope_, SFX))(const ELEM*, const ELEM*, const ELEM*, ELEM*, ELEM*, const int64_t*,
                                   int64_t, int64_t, int64_t, int64_t, int64_t, int);
typedef void (*CAT(dl_silu_, SFX))(const ELEM*, ELEM*, int64_t, int64_t, int);
typedef void (*CAT(dl_attend_, SFX))(const ELEM*, int64_t, const ELEM*, const int64_t*, int64_t,
                                     const int64_t*, const int64_t*, ELEM*, int64_t, int64_t, int64_t,
                                     int64_t, int64_t, int64_t, float, int);
typedef void (*CAT(dl_rope_q8_, SFX))(const ELEM*, const ELEM*, const ELEM*, ELEM*, int8_t*, const int64_t*,
                                      int64_t, int64_t, int64_t, int64_t, int64_t, int);
typedef int (*CAT(dl_attend_q8_, SFX))(const ELEM*, int64_t, const int8_t*, const int64_t*, int64_t,
                                       const int64_t*, const int64_t*, ELEM*, int64_t, int64_t, int64_t,
                                       int64_t, int64_t, int64_t, float, int, int);
typedef void (*CAT(dl_tile_, SFX))(const ELEM*, const uint8_t*, const ELEM*, ELEM*, int64_t, int64_t, int64_t,
                                   int);
typedef int (*CAT(dl_status_, SFX))(const ELEM*, const uint8_t*, const ELEM*, ELEM*, int64_t, int64_t,
                                    int64_t, int);
typedef void (*CAT(dl_panel_, SFX))(const ELEM*, float*, const ELEM*, const ELEM*, ELEM*, int64_t, int64_t,
                                    int64_t, int);

typedef int (*CAT(dl_lora_wf32_, SFX))(const ELEM*, int64_t, ELEM*, int64_t, const float*, int64_t, int64_t,
                                       const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                       const int64_t*, const int64_t*, const int64_t*, int64_t, int);
typedef int (*CAT(dl_lora_wbf16_, SFX))(const ELEM*, int64_t, ELEM*, int64_t, const uint16_t*, int64_t,
                                        int64_t, const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                        const int64_t*, const int64_t*, const int64_t*, int64_t, int);

/* y[T, g->n] += the LoRA delta of x[T, g->k] through lo's slots for the step's rows (lora.c's
   lora_add, the call cpu_decode_step's per-layer path makes): DL_OK, or DL_ENOMEM (no memory for
   the kernel's scratch rows; y not written). Nothing when the step has no LoRA rows or the
   target no slots. */
static int CAT(dl_lora_, SFX)(dl_model* m, const dl_lora* lo, const dl_gemm* g, const ELEM* x, ELEM* y,
                              int nt) {
    if (!m->lora_nseg || !lo->a) return DL_OK;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int rc;
    if (m->lora_wbf16)
        rc = ((CAT(dl_lora_wbf16_, SFX))m->lora)(x, g->k, y, g->n, (const uint16_t*)lo->a, lo->a_slot,
                                                 lo->a_row, (const uint16_t*)lo->b, lo->b_slot, lo->b_row,
                                                 g->k, lo->P, lo->R, lo->cols, m->lora_rows, m->lora_segs,
                                                 m->lora_nseg, nt);
    else
        rc = ((CAT(dl_lora_wf32_, SFX))m->lora)(
            x, g->k, y, g->n, (const float*)lo->a, lo->a_slot, lo->a_row, (const float*)lo->b, lo->b_slot,
            lo->b_row, g->k, lo->P, lo->R, lo->cols, m->lora_rows, m->lora_segs, m->lora_nseg, nt);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    m->lora_seconds += (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    return rc ? DL_ENOMEM : DL_OK;
}

/* y[T, g->n] = x[T, g->k] @ W^T (+ bias) by g's kernel: DL_OK, DL_ENOMEM (the kernel had no
   memory for its scratch; y not written) or DL_EINVAL (an unknown kind, or AMX off bfloat16). */
static int CAT(dl_gemm_, SFX)(const dl_gemm* g, const ELEM* x, ELEM* y, float* xf, int64_t T, int nt) {
    switch (g->kind) {
    case DL_TILE:
        ((CAT(dl_tile_, SFX))g->fn)(x, (const uint8_t*)g->w, (const ELEM*)g->bias, y, T, g->n, g->k, nt);
        return DL_OK;
    case DL_STATUS:
        return ((CAT(dl_status_, SFX))g->fn)(x, (const uint8_t*)g->w, (const ELEM*)g->bias, y, T, g->n, g->k,
                                             nt)
            ? DL_ENOMEM
            : DL_OK;
    case DL_PANEL:
        /* float32: the kernel reads x itself when xf == x (it widens only into another buffer) */
        ((CAT(dl_panel_, SFX))g->fn)(x, xf ? xf : (float*)(uintptr_t)x, (const ELEM*)g->w,
                                     (const ELEM*)g->bias, y, T, g->n, g->k, nt);
        return DL_OK;
    case DL_AMX:
        if (sizeof(ELEM) != 2) return DL_EINVAL;
        ((dl_amx_fn)g->fn)((const uint16_t*)(const void*)x, (const uint16_t*)g->w, (const uint16_t*)g->bias,
                           (uint16_t*)(void*)y, T, g->n, g->k, nt);
        return DL_OK;
    default: return DL_EINVAL;
    }
}

/* Every layer of m for T single-token decode rows, then the final norm (decode_layers.c).

   cos, sin: [T, D / 2] rotary tables of the rows' positions; slots: [T] cache slots;
   table [T, nbmax], kstart [T], kend [T]: the decode attention kernel's block table and key
   ranges; residual: [T, hidden], the embedded tokens, updated in place; out: [T, hidden], the
   hidden states after the final norm. With m->lora_nseg > 0 every target with LoRA slots adds
   the step's deltas after its GEMM (dl_lora_). Returns DL_OK, DL_ENOMEM (a GEMM or LoRA kernel
   had no memory for its scratch: out not written) or DL_EINVAL (T outside [1, max_rows], a bad
   dispatch entry, or LoRA rows without a LoRA kernel: nothing run). */
int CAT(decode_layers_, SFX)(dl_model* m, int64_t T, const ELEM* cos, const ELEM* sin, const int64_t* slots,
                             const int64_t* table, int64_t nbmax, const int64_t* kstart, const int64_t* kend,
                             ELEM* residual, ELEM* out, int nthreads) {
    if (!m || T < 1 || T > m->max_rows || m->num_layers < 1 || m->KH < 1 || m->H % m->KH) return DL_EINVAL;
    if (m->lora_nseg && (m->lora_nseg < 0 || !m->lora || !m->lora_rows || !m->lora_segs)) return DL_EINVAL;
    if (m->kv_quant < 0 || m->kv_quant > 1) return DL_EINVAL;
    for (int64_t i = 0; i < m->num_layers; ++i) {
        const dl_layer* l = m->layers + i;
        const dl_gemm* gs[4] = {&l->qkv, &l->o, &l->gate_up, &l->down};
        for (int j = 0; j < 4; ++j)
            if (!gs[j]->fn || gs[j]->kind < DL_TILE || gs[j]->kind > DL_AMX ||
                (gs[j]->kind == DL_AMX && sizeof(ELEM) != 2))
                return DL_EINVAL;
        if (!l->cache || !l->in_norm || !l->post_norm) return DL_EINVAL;
    }
    const CAT(dl_rms_, SFX) rms = (CAT(dl_rms_, SFX))m->rms;
    const CAT(dl_rope_, SFX) rope = (CAT(dl_rope_, SFX))m->rope;
    const CAT(dl_silu_, SFX) silu = (CAT(dl_silu_, SFX))m->silu;
    const CAT(dl_attend_, SFX) attend = (CAT(dl_attend_, SFX))m->attend;
    const int64_t hidden = m->hidden, H = m->H, KH = m->KH, D = m->D, G = H / KH;
    ELEM *h = (ELEM*)m->h, *o = (ELEM*)m->o, *mlp_out = (ELEM*)m->mlp_out, *qkv = (ELEM*)m->qkv;
    ELEM *qk = (ELEM*)m->qk, *attn_out = (ELEM*)m->attn_out, *gate_up = (ELEM*)m->gate_up,
         *act = (ELEM*)m->act;
    int rc;
    for (int64_t i = 0; i < m->num_layers; ++i) {
        const dl_layer* l = m->layers + i;
        ELEM* cache = (ELEM*)l->cache;
        /* layer 0 norms the embedded tokens; later ones first add the previous MLP output */
        if (i == 0) rms(residual, NULL, (const ELEM*)l->in_norm, h, T, hidden, l->in_eps, nthreads);
        else rms(mlp_out, residual, (const ELEM*)l->in_norm, h, T, hidden, l->in_eps, nthreads);
        if ((rc = CAT(dl_gemm_, SFX)(&l->qkv, h, qkv, m->xf, T, nthreads))) return rc;
        if ((rc = CAT(dl_lora_, SFX)(m, &l->lora_qkv, &l->qkv, h, qkv, nthreads))) return rc;
        /* q heads straight from qk's rows ((H + KH) * D apart); k/v are already in the cache */
        if (m->kv_quant) {
            ((CAT(dl_rope_q8_, SFX))m->rope)(qkv, cos, sin, qk, (int8_t*)l->cache, slots, T, H, KH, D,
                                             l->nb * l->bs, nthreads);
            if (((CAT(dl_attend_q8_, SFX))m->attend)(qk, (H + KH) * D, (const int8_t*)l->cache, table, nbmax,
                                                     kstart, kend, attn_out, T, KH, G, D, l->nb, l->bs,
                                                     l->scale, 0, nthreads))
                return DL_ENOMEM;
        } else {
            rope(qkv, cos, sin, qk, cache, slots, T, H, KH, D, l->nb * l->bs, nthreads);
            attend(qk, (H + KH) * D, cache, table, nbmax, kstart, kend, attn_out, T, KH, G, D, l->nb, l->bs,
                   l->scale, nthreads);
        }
        if ((rc = CAT(dl_gemm_, SFX)(&l->o, attn_out, o, m->xf, T, nthreads))) return rc;
        if ((rc = CAT(dl_lora_, SFX)(m, &l->lora_o, &l->o, attn_out, o, nthreads))) return rc;
        rms(o, residual, (const ELEM*)l->post_norm, h, T, hidden, l->post_eps, nthreads);
        if ((rc = CAT(dl_gemm_, SFX)(&l->gate_up, h, gate_up, m->xf, T, nthreads))) return rc;
        if ((rc = CAT(dl_lora_, SFX)(m, &l->lora_gate_up, &l->gate_up, h, gate_up, nthreads))) return rc;
        silu(gate_up, act, T, m->inter, nthreads);
        if ((rc = CAT(dl_gemm_, SFX)(&l->down, act, mlp_out, m->xf, T, nthreads))) return rc;
        if ((rc = CAT(dl_lora_, SFX)(m, &l->lora_down, &l->down, act, mlp_out, nthreads))) return rc;
    }
    rms(mlp_out, residual, (const ELEM*)m->final_norm, out, T, hidden, m->final_eps, nthreads);
    return DL_OK;
}
