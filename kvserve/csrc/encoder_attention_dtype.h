/* The dtype-generic kernel of encoder_attention.c, written with ELEM (storage type) and SFX
   (symbol suffix); instantiated by kv_instantiate.h. */

/* One item: query rows r0 .. r0 + nr - 1 (nr <= 16) of the sequence whose key rows are
   base .. base + L - 1, head h. sbuf holds L score vectors. */
static void CAT(ea_item_, SFX)(const ELEM* qkv, int64_t qs, ELEM* out, int64_t os, int64_t H, int64_t D,
                               float scale, int64_t base, int64_t L, int64_t r0, int64_t nr, int64_t h,
                               v16* sbuf) {
    v16 qT[EA_MAX_D];
    for (int64_t d = 0; d < D; d++) qT[d] = (v16){};
    for (int64_t r = 0; r < nr; r++) {
        const ELEM* q = qkv + (r0 + r) * qs + h * D;
        for (int64_t d = 0; d < D; d++) qT[d][r] = CAT(ld1_, SFX)(q + d) * scale;
    }
    const ELEM* kbase = qkv + base * qs + H + h * D;
    const ELEM* vbase = qkv + base * qs + 2 * H + h * D;
    v16 mx = (v16){} - INFINITY;
    int64_t j = 0;
    for (; j + 4 <= L; j += 4) {
        const ELEM* k0 = kbase + j * qs;
        const ELEM* k1 = k0 + qs;
        const ELEM* k2 = k1 + qs;
        const ELEM* k3 = k2 + qs;
        v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
        for (int64_t d = 0; d < D; d++) {
            const v16 qd = qT[d];
            a0 += CAT(ld1_, SFX)(k0 + d) * qd;
            a1 += CAT(ld1_, SFX)(k1 + d) * qd;
            a2 += CAT(ld1_, SFX)(k2 + d) * qd;
            a3 += CAT(ld1_, SFX)(k3 + d) * qd;
        }
        sbuf[j] = a0;
        sbuf[j + 1] = a1;
        sbuf[j + 2] = a2;
        sbuf[j + 3] = a3;
        mx = vmax(vmax(mx, a0), vmax(vmax(a1, a2), a3));
    }
    for (; j < L; j++) {
        const ELEM* k = kbase + j * qs;
        v16 a = {};
        for (int64_t d = 0; d < D; d++) a += CAT(ld1_, SFX)(k + d) * qT[d];
        sbuf[j] = a;
        mx = vmax(mx, a);
    }
    v16 l = {};
    for (j = 0; j < L; j++) {
        const v16 p = exp16(sbuf[j] - mx);
        sbuf[j] = p;
        l += p;
    }
    const v16 inv = 1.0f / l;
    /* O^T by blocks of 8 head dimensions, then written back transposed (row r = lane r) */
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
        v16 o0 = {}, o1 = {}, o2 = {}, o3 = {}, o4 = {}, o5 = {}, o6 = {}, o7 = {};
        for (j = 0; j < L; j++) {
            const ELEM* v = vbase + j * qs + d0;
            const v16 p = sbuf[j];
            o0 += p * CAT(ld1_, SFX)(v);
            o1 += p * CAT(ld1_, SFX)(v + 1);
            o2 += p * CAT(ld1_, SFX)(v + 2);
            o3 += p * CAT(ld1_, SFX)(v + 3);
            o4 += p * CAT(ld1_, SFX)(v + 4);
            o5 += p * CAT(ld1_, SFX)(v + 5);
            o6 += p * CAT(ld1_, SFX)(v + 6);
            o7 += p * CAT(ld1_, SFX)(v + 7);
        }
        const v16 ob[8] = {o0 * inv, o1 * inv, o2 * inv, o3 * inv, o4 * inv, o5 * inv, o6 * inv, o7 * inv};
        for (int64_t r = 0; r < nr; r++) {
            ELEM* o = out + (r0 + r) * os + h * D + d0;
            for (int i = 0; i < 8; i++) CAT(st1_, SFX)(o + i, ob[i][r]);
        }
    }
}

/* Bidirectional attention of S packed sequences (contract in encoder_attention.c); nthreads
   OpenMP threads. Returns 0, or 1 when a score buffer could not be allocated (nothing
   written then by that thread's items: the caller raises). */
int CAT(encoder_attention_, SFX)(const ELEM* qkv, int64_t qs, const int64_t* cu, int64_t S, ELEM* out,
                                 int64_t os, int64_t NH, int64_t D, float scale, int nthreads) {
    const int64_t H = NH * D;
    int64_t ntiles = 0, maxL = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t L = cu[s + 1] - cu[s];
        ntiles += (L + 15) / 16;
        if (L > maxL) maxL = L;
    }
    if (ntiles == 0) return 0;
    /* tile t of all sequences: its sequence and first row */
    int64_t* tseq = (int64_t*)malloc(2 * ntiles * sizeof(int64_t));
    if (!tseq) return 1;
    int64_t* trow = tseq + ntiles;
    for (int64_t s = 0, t = 0; s < S; s++)
        for (int64_t r = cu[s]; r < cu[s + 1]; r += 16, t++) {
            tseq[t] = s;
            trow[t] = r;
        }
    int failed = 0;
    const int64_t nitems = ntiles * NH;
#pragma omp parallel num_threads(nitems >= 4 ? nthreads : 1)
    {
        v16* sbuf = (v16*)aligned_alloc(64, (size_t)(maxL + 4) * sizeof(v16));
        if (!sbuf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nitems; it++) {
            if (!sbuf) continue;
            const int64_t t = it / NH, h = it % NH, s = tseq[t];
            const int64_t end = cu[s + 1], r0 = trow[t];
            const int64_t nr = end - r0 < 16 ? end - r0 : 16;
            CAT(ea_item_, SFX)(qkv, qs, out, os, H, D, scale, cu[s], end - cu[s], r0, nr, h, sbuf);
        }
        free(sbuf);
    }
    free(tseq);
    return failed;
}
