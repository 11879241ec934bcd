/* The dtype-generic step of decode_layers.c, written with ELEM (storage type) and SFX (symbol
   suffix): included once per dtype through kv_instantiate.h, hence no include guard. The
   function pointer types are the kernels' own prototypes (ops_dtype.h, decode_attention_dtype.h,
   gemm_dtype.h, quant_gemm_dtype.h, amx_gemm.c). */
typedef void (*CAT(dl_rms_, SFX))(const ELEM*, ELEM*, const ELEM*, ELEM*, int64_t, int64_t, float, int);
typedef void (*CAT(dl_rope_, SFX))(const ELEM*, const ELEM*, const ELEM*, ELEM*, ELEM*, const int64_t*,
                                   int64_t, int64_t, int64_t, int64_t, int64_t, int);
typedef void (*CAT(dl_offrms_, SFX))(const ELEM*, int64_t, const float*, const ELEM*, ELEM*, int64_t, int64_t,
                                     int64_t, int64_t, float, int);
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

/* The per-head q and k norms of the fused qkv rows [T, (H + 2 KH) D] in place (no-op without
   them): offset_rms over the heads (Gemma 3), or rms_norm of each token's heads (Qwen3: its
   rows are one token's heads, contiguous; a token at a time as the rows lie apart). */
static void CAT(dl_qk_norm_, SFX)(const dl_model* m, const dl_layer* l, ELEM* qkv, int64_t T, int nt) {
    if (!l->q_norm) return;
    const int64_t H = m->H, KH = m->KH, D = m->D, C = (H + 2 * KH) * D;
    if (m->gemma) {
        const CAT(dl_offrms_, SFX) off = (CAT(dl_offrms_, SFX))m->offset_rms;
        off(qkv, C, (const float*)l->q_norm, NULL, qkv, C, T, H, D, l->q_eps, nt);
        off(qkv + H * D, C, (const float*)l->k_norm, NULL, qkv + H * D, C, T, KH, D, l->k_eps, nt);
        return;
    }
    const CAT(dl_rms_, SFX) rms = (CAT(dl_rms_, SFX))m->rms;
    for (int64_t t = 0; t < T; ++t) {
        ELEM* q = qkv + t * C;
        rms(q, NULL, (const ELEM*)l->q_norm, q, H, D, l->q_eps, nt);
        rms(q + H * D, NULL, (const ELEM*)l->k_norm, q + H * D, KH, D, l->k_eps, nt);
    }
}

/* Rotary + cache write of the layer's new k / v rows, then decode attention of its q heads
   (straight from m->qk's rows, (H + KH) D apart; k / v are then in the cache) over the key ranges
   k, into m->attn_out. int8 caches (m->kv_quant) take the q8 kernels: codes and float16 scale
   written together, integer dot products where the CPU has VNNI. DL_ENOMEM when the q8 kernel
   had no memory for its scratch. */
static int CAT(dl_rope_attend_, SFX)(const dl_model* m, const dl_layer* l, ELEM* qkv, const ELEM* cos,
                                     const ELEM* sin, const int64_t* slots, const dl_keys* k, int64_t T,
                                     int nt) {
    const int64_t H = m->H, KH = m->KH, D = m->D, G = H / KH, nslots = l->nb * l->bs;
    ELEM *qk = (ELEM*)m->qk, *attn_out = (ELEM*)m->attn_out;
    if (m->kv_quant) {
        int8_t* cache = (int8_t*)l->cache;
        ((CAT(dl_rope_q8_, SFX))m->rope)(qkv, cos, sin, qk, cache, slots, T, H, KH, D, nslots, nt);
        return ((CAT(dl_attend_q8_, SFX))m->attend)(qk, (H + KH) * D, cache, k->table, k->nbmax, k->kstart,
                                                    k->kend, attn_out, T, KH, G, D, l->nb, l->bs, l->scale, 0,
                                                    nt)
            ? DL_ENOMEM
            : DL_OK;
    }
    ELEM* cache = (ELEM*)l->cache;
    ((CAT(dl_rope_, SFX))m->rope)(qkv, cos, sin, qk, cache, slots, T, H, KH, D, nslots, nt);
    ((CAT(dl_attend_, SFX))m->attend)(qk, (H + KH) * D, cache, k->table, k->nbmax, k->kstart, k->kend,
                                      attn_out, T, KH, G, D, l->nb, l->bs, l->scale, nt);
    return DL_OK;
}

/* Gemma's layers (m->gemma; decode_layers.c): residual [T, hidden] updated in place, out the
   final norm of it. Arguments as decode_layers_ (the key ranges of layer l: m->keys[l->keys]
   with nkeys > 0, else the arguments'); results DL_OK or a GEMM's / LoRA kernel's DL_ENOMEM. */
static int CAT(dl_gemma_, SFX)(dl_model* m, int64_t T, const ELEM* cos, const ELEM* sin, const int64_t* slots,
                               const dl_keys* args, ELEM* residual, ELEM* out, int nt) {
    const CAT(dl_offrms_, SFX) off = (CAT(dl_offrms_, SFX))m->offset_rms;
    const CAT(dl_silu_, SFX) gelu = (CAT(dl_silu_, SFX))m->gelu;
    const int64_t hidden = m->hidden;
    ELEM *h = (ELEM*)m->h, *o = (ELEM*)m->o, *mlp_out = (ELEM*)m->mlp_out, *qkv = (ELEM*)m->qkv;
    ELEM *attn_out = (ELEM*)m->attn_out, *gate_up = (ELEM*)m->gate_up, *act = (ELEM*)m->act;
    int rc;
    for (int64_t i = 0; i < m->num_layers; ++i) {
        const dl_layer* l = m->layers + i;
        const dl_keys* k = m->nkeys ? m->keys + l->keys : args;
        const ELEM* c = l->local_rope ? (const ELEM*)m->cos_local : cos;
        const ELEM* s = l->local_rope ? (const ELEM*)m->sin_local : sin;
        off(residual, hidden, (const float*)l->in_norm, NULL, h, hidden, T, 1, hidden, l->in_eps, nt);
        if ((rc = CAT(dl_gemm_, SFX)(&l->qkv, h, qkv, m->xf, T, nt))) return rc;
        if ((rc = CAT(dl_lora_, SFX)(m, &l->lora_qkv, &l->qkv, h, qkv, nt))) return rc;
        CAT(dl_qk_norm_, SFX)(m, l, qkv, T, nt);
        if ((rc = CAT(dl_rope_attend_, SFX)(m, l, qkv, c, s, slots, k, T, nt))) return rc;
        if ((rc = CAT(dl_gemm_, SFX)(&l->o, attn_out, o, m->xf, T, nt))) return rc;
        if ((rc = CAT(dl_lora_, SFX)(m, &l->lora_o, &l->o, attn_out, o, nt))) return rc;
        /* residual += post_norm(o), in place: each element of add is read before it is written */
        off(o, hidden, (const float*)l->post_norm, residual, residual, hidden, T, 1, hidden, l->post_eps, nt);
        off(residual, hidden, (const float*)l->pre_ff_norm, NULL, h, hidden, T, 1, hidden, l->pre_ff_eps, nt);
        if ((rc = CAT(dl_gemm_, SFX)(&l->gate_up, h, gate_up, m->xf, T, nt))) return rc;
        if ((rc = CAT(dl_lora_, SFX)(m, &l->lora_gate_up, &l->gate_up, h, gate_up, nt))) return rc;
        gelu(gate_up, act, T, m->inter, nt);
        if ((rc = CAT(dl_gemm_, SFX)(&l->down, act, mlp_out, m->xf, T, nt))) return rc;
        if ((rc = CAT(dl_lora_, SFX)(m, &l->lora_down, &l->down, act, mlp_out, nt))) return rc;
        off(mlp_out, hidden, (const float*)l->post_ff_norm, residual, residual, hidden, T, 1, hidden,
            l->post_ff_eps, nt);
    }
    off(residual, hidden, (const float*)m->final_norm, NULL, out, hidden, T, 1, hidden, m->final_eps, nt);
    return DL_OK;
}

/* Every layer of m for T single-token decode rows, then the final norm (decode_layers.c).

   cos, sin: [T, D / 2] rotary tables of the rows' positions; slots: [T] cache slots;
   table [T, nbmax], kstart [T], kend [T]: the decode attention kernel's block table and key
   ranges; residual: [T, hidden], the embedded tokens, updated in place; out: [T, hidden], the
   hidden states after the final norm. Gemma layers (m->gemma) run dl_gemma_. With m->nkeys > 0
   each layer attends with m->keys[l->keys] instead of table / kstart / kend. Per-head q / k
   norms run where a layer has them (dl_qk_norm_). With m->lora_nseg > 0 every target with LoRA slots adds
   the step's deltas after its GEMM (dl_lora_). Returns DL_OK, DL_ENOMEM (a GEMM or LoRA kernel
   had no memory for its scratch: out not written) or DL_EINVAL (T outside [1, max_rows], a bad
   dispatch entry, a missing Gemma kernel / norm / window entry, or LoRA rows without a LoRA
   kernel: nothing run). */
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
        if (!l->cache || !l->in_norm || !l->post_norm || !l->q_norm != !l->k_norm) return DL_EINVAL;
        if (m->nkeys && (l->keys < 0 || l->keys >= m->nkeys)) return DL_EINVAL;
        if (m->gemma && (!l->pre_ff_norm || !l->post_ff_norm || (l->local_rope && !m->cos_local)))
            return DL_EINVAL;
    }
    if (m->nkeys < 0 || m->nkeys > DL_MAX_KEYS || (m->gemma && (!m->offset_rms || !m->gelu)))
        return DL_EINVAL;
    for (int64_t j = 0; j < m->nkeys; ++j)
        if (!m->keys[j].table || !m->keys[j].kstart || !m->keys[j].kend) return DL_EINVAL;
    const dl_keys args = {table, nbmax, kstart, kend};
    if (m->gemma) return CAT(dl_gemma_, SFX)(m, T, cos, sin, slots, &args, residual, out, nthreads);
    const CAT(dl_rms_, SFX) rms = (CAT(dl_rms_, SFX))m->rms;
    const CAT(dl_silu_, SFX) silu = (CAT(dl_silu_, SFX))m->silu;
    const int64_t hidden = m->hidden;
    ELEM *h = (ELEM*)m->h, *o = (ELEM*)m->o, *mlp_out = (ELEM*)m->mlp_out, *qkv = (ELEM*)m->qkv;
    ELEM *attn_out = (ELEM*)m->attn_out, *gate_up = (ELEM*)m->gate_up, *act = (ELEM*)m->act;
    int rc;
    for (int64_t i = 0; i < m->num_layers; ++i) {
        const dl_layer* l = m->layers + i;
        /* layer 0 norms the embedded tokens; later ones first add the previous MLP output */
        if (i == 0) rms(residual, NULL, (const ELEM*)l->in_norm, h, T, hidden, l->in_eps, nthreads);
        else rms(mlp_out, residual, (const ELEM*)l->in_norm, h, T, hidden, l->in_eps, nthreads);
        if ((rc = CAT(dl_gemm_, SFX)(&l->qkv, h, qkv, m->xf, T, nthreads))) return rc;
        if ((rc = CAT(dl_lora_, SFX)(m, &l->lora_qkv, &l->qkv, h, qkv, nthreads))) return rc;
        CAT(dl_qk_norm_, SFX)(m, l, qkv, T, nthreads);
        const dl_keys* k = m->nkeys ? m->keys + l->keys : &args;
        if ((rc = CAT(dl_rope_attend_, SFX)(m, l, qkv, cos, sin, slots, k, T, nthreads))) return rc;
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
