/* One instantiation of lora.c's kernel: activations X_ELEM (suffix X_DTYPE: f32 / bf16),
   weights W_ELEM (W_DTYPE). Included once per pair by lora.c (no include guard); undefines its
   parameters at the end. */
#define LK(name) CAT(CAT(CAT(CAT(name, _), X_DTYPE), _w), W_DTYPE)
#define LDX1 CAT(ld1_, X_DTYPE)
#define LDX16 CAT(ld16_, X_DTYPE)
#define STX1 CAT(st1_, X_DTYPE)
#define STX16 CAT(st16_, X_DTYPE)
#define LDW1 CAT(ld1_, W_DTYPE)
#define LDW16 CAT(ld16_, W_DTYPE)

/* h[m * ldh + v * 16 + i] = sum_j xs[m * in + j] * a[j * lda + v * 16 + i] for m < mr, v < nv:
   the shrink of mr (widened) rows onto 16 * nv rank columns. mr and nv are constants at every
   call site (LK(shrink)'s switch), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void LK(shrink_tile)(const float* xs, const int mr, const int nv,
                                                                  int64_t in, const W_ELEM* a, int64_t lda,
                                                                  float* h, int64_t ldh) {
    v16 acc[LORA_MR][3];
    for (int m = 0; m < mr; ++m)
        for (int v = 0; v < 3; ++v) acc[m][v] = (v16){};
    for (int64_t j = 0; j < in; ++j) {
        const W_ELEM* aj = a + j * lda;
        v16 w[3] = {(v16){}, (v16){}, (v16){}};
        for (int v = 0; v < nv; ++v) w[v] = LDW16(aj + 16 * v);
        for (int m = 0; m < mr; ++m) {
            const v16 xb = splat16(xs[m * in + j]);
            for (int v = 0; v < nv; ++v) acc[m][v] += xb * w[v];
        }
    }
    for (int m = 0; m < mr; ++m)
        for (int v = 0; v < nv; ++v) st16_f32(h + m * ldh + 16 * v, acc[m][v]);
}

/* out_m[v * 16 + i] += sum_r h[m * ldh + r] * b[r * ldb + v * 16 + i] (r < R) for m < mr,
   v < nv, rounded once to X_ELEM: the expand of mr rows onto 16 * nv output columns. */
static inline __attribute__((always_inline)) void LK(expand_tile)(const float* h, int64_t ldh, const int mr,
                                                                  const int nv, int64_t R, const W_ELEM* b,
                                                                  int64_t ldb, X_ELEM* const* outr,
                                                                  int64_t col) {
    v16 acc[LORA_MR][3];
    for (int m = 0; m < mr; ++m)
        for (int v = 0; v < 3; ++v) acc[m][v] = (v16){};
    for (int64_t r = 0; r < R; ++r) {
        const W_ELEM* br = b + r * ldb;
        v16 w[3] = {(v16){}, (v16){}, (v16){}};
        for (int v = 0; v < nv; ++v) w[v] = LDW16(br + 16 * v);
        for (int m = 0; m < mr; ++m) {
            const v16 hb = splat16(h[m * ldh + r]);
            for (int v = 0; v < nv; ++v) acc[m][v] += hb * w[v];
        }
    }
    for (int m = 0; m < mr; ++m)
        for (int v = 0; v < nv; ++v) {
            X_ELEM* o = outr[m] + col + 16 * v;
            STX16(o, LDX16(o) + acc[m][v]);
        }
}

#define LORA_TILE_CASES(CALL)                                                                                \
    switch (mr) {                                                                                            \
    case 1: CALL(1); break;                                                                                  \
    case 2: CALL(2); break;                                                                                  \
    case 3: CALL(3); break;                                                                                  \
    case 4: CALL(4); break;                                                                                  \
    case 5: CALL(5); break;                                                                                  \
    case 6: CALL(6); break;                                                                                  \
    case 7: CALL(7); break;                                                                                  \
    default: CALL(8); break;                                                                                 \
    }

/* The shrink of mr rows (xs: [mr, in] float32) through one slot's A (a: [in, w] with row
   stride lda) into h. */
static void LK(shrink)(const float* xs, int mr, int64_t in, const W_ELEM* a, int64_t lda, int64_t w, float* h,
                       int64_t ldh) {
    int64_t c = 0;
    for (; c + 48 <= w; c += 48) {
#define SHRINK3(MR) LK(shrink_tile)(xs, MR, 3, in, a + c, lda, h + c, ldh)
        LORA_TILE_CASES(SHRINK3)
#undef SHRINK3
    }
    if (c + 32 <= w) {
#define SHRINK2(MR) LK(shrink_tile)(xs, MR, 2, in, a + c, lda, h + c, ldh)
        LORA_TILE_CASES(SHRINK2)
#undef SHRINK2
        c += 32;
    } else if (c + 16 <= w) {
#define SHRINK1(MR) LK(shrink_tile)(xs, MR, 1, in, a + c, lda, h + c, ldh)
        LORA_TILE_CASES(SHRINK1)
#undef SHRINK1
        c += 16;
    }
    for (; c < w; ++c) /* rank columns past the last multiple of 16 */
        for (int m = 0; m < mr; ++m) {
            float s = 0.0f;
            for (int64_t j = 0; j < in; ++j) s += xs[m * in + j] * LDW1(a + j * lda + c);
            h[m * ldh + c] = s;
        }
}

/* The expand of mr rows of h (R rank columns) through b ([R, n] with row stride ldb) into
   columns [col, col + n) of the rows outr. */
static void LK(expand)(const float* h, int64_t ldh, int mr, int64_t R, const W_ELEM* b, int64_t ldb,
                       X_ELEM* const* outr, int64_t col, int64_t n) {
    int64_t c = 0;
    for (; c + 48 <= n; c += 48) {
#define EXPAND3(MR) LK(expand_tile)(h, ldh, MR, 3, R, b + c, ldb, outr, col + c)
        LORA_TILE_CASES(EXPAND3)
#undef EXPAND3
    }
    if (c + 32 <= n) {
#define EXPAND2(MR) LK(expand_tile)(h, ldh, MR, 2, R, b + c, ldb, outr, col + c)
        LORA_TILE_CASES(EXPAND2)
#undef EXPAND2
        c += 32;
    } else if (c + 16 <= n) {
#define EXPAND1(MR) LK(expand_tile)(h, ldh, MR, 1, R, b + c, ldb, outr, col + c)
        LORA_TILE_CASES(EXPAND1)
#undef EXPAND1
        c += 16;
    }
    for (; c < n; ++c) /* output columns past the last multiple of 16 */
        for (int m = 0; m < mr; ++m) {
            float s = 0.0f;
            for (int64_t r = 0; r < R; ++r) s += h[m * ldh + r] * LDW1(b + r * ldb + c);
            X_ELEM* o = outr[m] + col + c;
            STX1(o, LDX1(o) + s);
        }
}

/* Rows lo .. lo + mr - 1 of `rows` (one chunk of one slot): their output row pointers into
   outr (rows past mr point at the first: never written, but defined) and, widened to float32,
   their inputs into xs ([mr, in]). */
static void LK(chunk_rows)(const X_ELEM* x, int64_t ldx, X_ELEM* out, int64_t ldo, const int64_t* rows,
                           int64_t lo, int mr, int64_t in, float* xs, X_ELEM** outr) {
    for (int m = 0; m < LORA_MR; ++m) {
        const int64_t t = rows[lo + (m < mr ? m : 0)];
        outr[m] = out + t * ldo;
        if (m >= mr) continue;
        const X_ELEM* xr = x + t * ldx;
        int64_t j = 0;
        for (; j + 16 <= in; j += 16) st16_f32(xs + m * in + j, LDX16(xr + j));
        for (; j < in; ++j) xs[m * in + j] = LDX1(xr + j);
    }
}

/* lora_add for a small step on several threads (lora.c's header comment: "Threads"): the
   chunks' shrinks split over the threads in 16-rank-column blocks, then, after a barrier, their
   expands in 48-output-column blocks, so 1 or 3 chunks keep 2 threads busy as 2 or 4 do. Each
   thread takes one contiguous range of the blocks and runs each chunk's share of it as one
   shrink / expand call over those columns: the splits fall on the tiles' own boundaries (16 and
   48 columns from a part's start), so every element is the same FMA chain as in the one-thread
   form, bit for bit. Scratch: every chunk's widened rows and rank sums (nchunks * LORA_MR *
   (in + P * R) floats). */
static int LK(lora_add_split)(const X_ELEM* x, int64_t ldx, X_ELEM* out, int64_t ldo, const W_ELEM* a,
                              int64_t a_slot, int64_t a_row, const W_ELEM* b, int64_t b_slot, int64_t b_row,
                              int64_t in, int64_t P, int64_t R, const int64_t* cols, const int64_t* rows,
                              const int64_t* segs, int64_t nseg, int64_t nchunks, int nthreads) {
    const int64_t w = P * R, nsv = (w + 15) / 16;
    int64_t cslot[LORA_SPLIT_MAX_CHUNKS], clo[LORA_SPLIT_MAX_CHUNKS];
    int cmr[LORA_SPLIT_MAX_CHUNKS];
    int64_t nc = 0;
    for (int64_t g = 0; g < nseg; ++g)
        for (int64_t lo = segs[3 * g + 1]; lo < segs[3 * g + 2]; lo += LORA_MR, ++nc) {
            cslot[nc] = segs[3 * g];
            clo[nc] = lo;
            cmr[nc] = (int)(segs[3 * g + 2] - lo < LORA_MR ? segs[3 * g + 2] - lo : LORA_MR);
        }
    int64_t nexp = 0; /* 48-column expand blocks per chunk, over all parts */
    for (int64_t p = 0; p < P; ++p) nexp += (cols[p + 1] - cols[p] + 47) / 48;
    const int64_t per_chunk = LORA_MR * (in + w);
    float* scratch = (float*)malloc(sizeof(float) * (size_t)(nchunks * per_chunk));
    X_ELEM** outr = (X_ELEM**)malloc(sizeof(X_ELEM*) * (size_t)(nchunks * LORA_MR));
    if (!scratch || !outr) {
        free(scratch);
        free(outr);
        return 1;
    }
    const int nt = nthreads;
#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#pragma omp for schedule(static)
        for (int64_t ci = 0; ci < nchunks; ++ci)
            LK(chunk_rows)(x, ldx, out, ldo, rows, clo[ci], cmr[ci], in, scratch + ci * per_chunk,
                           outr + ci * LORA_MR);
        /* (the implicit barrier: every chunk's rows widened) shrink blocks [lo, hi) of
           nchunks * nsv, chunk-major */
        int64_t lo = nchunks * nsv * tid / nth, hi = nchunks * nsv * (tid + 1) / nth;
        while (lo < hi) {
            const int64_t ci = lo / nsv, v0 = lo % nsv, v1 = (hi - ci * nsv < nsv ? hi - ci * nsv : nsv);
            const int64_t c0 = 16 * v0, c1 = (16 * v1 < w ? 16 * v1 : w);
            float* xs = scratch + ci * per_chunk;
            LK(shrink)(xs, cmr[ci], in, a + cslot[ci] * a_slot + c0, a_row, c1 - c0, xs + LORA_MR * in + c0,
                       w);
            lo = ci * nsv + v1;
        }
#pragma omp barrier
        /* expand blocks [lo, hi) of nchunks * nexp: chunk-major, then part, then 48 columns */
        lo = nchunks * nexp * tid / nth;
        hi = nchunks * nexp * (tid + 1) / nth;
        while (lo < hi) {
            const int64_t ci = lo / nexp;
            int64_t k = lo % nexp, p = 0, nb;
            for (;; ++p) { /* block k of the chunk -> its part p and block within it */
                nb = (cols[p + 1] - cols[p] + 47) / 48;
                if (k < nb) break;
                k -= nb;
            }
            const int64_t take = (nb - k < hi - lo ? nb - k : hi - lo); /* blocks of part p */
            const int64_t n0 = cols[p] + 48 * k,
                          n1 = (cols[p] + 48 * (k + take) < cols[p + 1]) ? cols[p] + 48 * (k + take)
                                                                         : cols[p + 1];
            const float* h = scratch + ci * per_chunk + LORA_MR * in;
            LK(expand)(h + p * R, w, cmr[ci], R, b + cslot[ci] * b_slot + p * R * b_row + n0, b_row,
                       outr + ci * LORA_MR, n0, n1 - n0);
            lo += take;
        }
    }
    free(scratch);
    free(outr);
    return 0;
}

/* The batched LoRA delta of one fused linear (lora.c's header comment). Returns 0, or 1 (nothing
   written) when there is no memory for the scratch rows.

   x: [T, in] activations, row stride ldx; out: [T, >= cols[P]], row stride ldo (in place).
   a: slot s's A element (j, c) (input feature j, rank column c < P * R) at
      a[s * a_slot + j * a_row + c]; b: slot s's B element (r, n) at b[s * b_slot + r * b_row + n].
   cols: [P + 1] increasing column bounds: part p owns rank columns [p * R, (p + 1) * R) and
   output columns [cols[p], cols[p + 1]).
   rows: the rows with a slot, grouped by slot; segs: [nseg * 3] (slot, start, end), rows
   [start, end) of `rows` running `slot`. Rows not in `rows` are not touched. */
int LK(lora_add)(const X_ELEM* x, int64_t ldx, X_ELEM* out, int64_t ldo, const W_ELEM* a, int64_t a_slot,
                 int64_t a_row, const W_ELEM* b, int64_t b_slot, int64_t b_row, int64_t in, int64_t P,
                 int64_t R, const int64_t* cols, const int64_t* rows, const int64_t* segs, int64_t nseg,
                 int nthreads) {
    int64_t nchunks = 0;
    for (int64_t g = 0; g < nseg; ++g) nchunks += (segs[3 * g + 2] - segs[3 * g + 1] + LORA_MR - 1) / LORA_MR;
    if (nchunks == 0) return 0;
    const int64_t w = P * R;
    /* (chunks a multiple of the threads balance as whole chunks: no barrier to pay) */
    if (nthreads > 1 && nchunks <= LORA_SPLIT_MAX_CHUNKS && nchunks % nthreads)
        return LK(lora_add_split)(x, ldx, out, ldo, a, a_slot, a_row, b, b_slot, b_row, in, P, R, cols, rows,
                                  segs, nseg, nchunks, nthreads);
    const int nt = nchunks >= 2 && nthreads > 1 ? (int)(nchunks < nthreads ? nchunks : nthreads) : 1;
    /* per thread: the chunk's rows of x widened to float32 (the shrink reads each one in
       times), then their rank sums; on the heap, as `in` may be large */
    const int64_t per_thread = LORA_MR * (in + w);
    float* scratch = (float*)malloc(sizeof(float) * (size_t)(nt * per_thread));
    if (!scratch) return 1;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t ci = 0; ci < nchunks; ++ci) {
        float* xs = scratch + omp_get_thread_num() * per_thread;
        float* h = xs + LORA_MR * in;
        /* chunk ci -> its segment and first row (segments are few: max_loras at most) */
        int64_t g = 0, k = ci;
        for (;; ++g) {
            const int64_t n = (segs[3 * g + 2] - segs[3 * g + 1] + LORA_MR - 1) / LORA_MR;
            if (k < n) break;
            k -= n;
        }
        const int64_t slot = segs[3 * g], lo = segs[3 * g + 1] + k * LORA_MR, end = segs[3 * g + 2];
        const int mr = (int)(end - lo < LORA_MR ? end - lo : LORA_MR);
        X_ELEM* outr[LORA_MR];
        LK(chunk_rows)(x, ldx, out, ldo, rows, lo, mr, in, xs, outr);
        LK(shrink)(xs, mr, in, a + slot * a_slot, a_row, w, h, w);
        for (int64_t p = 0; p < P; ++p)
            LK(expand)(h + p * R, w, mr, R, b + slot * b_slot + p * R * b_row + cols[p], b_row, outr, cols[p],
                       cols[p + 1] - cols[p]);
    }
    free(scratch);
    return 0;
}

#undef LORA_TILE_CASES
#undef LK
#undef LDX1
#undef LDX16
#undef STX1
#undef STX16
#undef LDW1
#undef LDW16
#undef X_DTYPE
#undef X_ELEM
#undef W_DTYPE
#undef W_ELEM
