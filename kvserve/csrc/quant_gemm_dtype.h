/* The activation-dtype-generic kernels of quant_gemm.c, written with ELEM (storage type of x,
   y and the bias) and SFX (symbol suffix): included once per dtype through kv_instantiate.h,
   hence no include guard. */

/* mr (<= MR) rows of x times nc (<= NC) weight rows, all K: y[r * ldy + c] = x_r . w_c (+ b_c).
   w: the nc rows, row_bytes apart. mr and nc are literals at the hot call sites. */
static inline __attribute__((always_inline)) void
CAT(qtile_, SFX)(const int qt, const int mr, const int nc, const ELEM* x, const int64_t K, const uint8_t* w,
                 const int64_t row_bytes, const ELEM* bias, ELEM* y, const int64_t ldy) {
    v16 acc[MR][NC];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) acc[r][c] = (v16){};
    const int64_t nb = K / QK;
    for (int64_t j = 0; j < nb; ++j) {
        const ELEM* xj = x + j * QK;
#pragma GCC unroll 4
        for (int c = 0; c < nc; ++c) {
            v16 w0, w1;
            dequant_block(qt, w + c * row_bytes, j, &w0, &w1);
            /* x straight from L1 (a memory operand of the FMA): no registers held for it */
#pragma GCC unroll 8
            for (int r = 0; r < mr; ++r) {
                acc[r][c] += CAT(ld16_, SFX)(xj + r * K) * w0;
                acc[r][c] += CAT(ld16_, SFX)(xj + r * K + 16) * w1;
            }
        }
    }
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < nc; ++c) {
            const float b = bias ? CAT(ld1_, SFX)(bias + c) : 0.0f;
            CAT(st1_, SFX)(y + r * ldy + c, hsum16(acc[r][c]) + b);
        }
}

/* Thread tid of nth's share of y[M, N] = x[M, K] @ W^T (+ bias[N]) for W [N, K] in blocks of
   type qt (K a multiple of its block). The threads split the column tiles; rows go in chunks of ~256 KB of x
   (as float32), so a chunk stays in L2 while the thread's weight tiles pass over it. Called
   from inside the parallel region of each exported function: GCC outlines a parallel region
   before inlining, so one inside this function would see qt as a variable and keep the
   per-type branches in the inner loop (several times slower). */
static inline __attribute__((always_inline)) void
CAT(qgemm_, SFX)(const int qt, const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y, const int64_t M,
                 const int64_t N, const int64_t K, const int tid, const int nth) {
    const int64_t row_bytes = K / QK / block_chunks(qt) * block_bytes(qt);
    const int64_t tiles = (N + NC - 1) / NC;
    int64_t mc = K > 0 ? ((int64_t)(1 << 16) / K) / MR * MR : MR;
    if (mc < MR) mc = MR;
    {
        const int64_t t_begin = tiles * tid / nth, t_end = tiles * (tid + 1) / nth;
        const int64_t pf_tiles = prefetch_tiles(NC * row_bytes);
        for (int64_t m0 = 0; m0 < M; m0 += mc) {
            const int64_t m_end = m0 + mc < M ? m0 + mc : M;
            for (int64_t t = t_begin; t < t_end; ++t) {
                const int64_t n = t * NC;
                const int nc = N - n < NC ? (int)(N - n) : NC;
                const uint8_t* wt = w + n * row_bytes;
                const ELEM* bt = bias ? bias + n : NULL;
                if (m0 == 0) prefetch_tile(wt, NC * row_bytes, pf_tiles, t_end - t);
                for (int64_t m = m0; m < m_end; m += MR) {
                    const int mr = m_end - m < MR ? (int)(m_end - m) : MR;
                    const ELEM* xm = x + m * K;
                    ELEM* ym = y + m * N + n;
                    if (nc == NC) {
                        switch (mr) {
                        case 8: CAT(qtile_, SFX)(qt, 8, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        case 7: CAT(qtile_, SFX)(qt, 7, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        case 6: CAT(qtile_, SFX)(qt, 6, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        case 5: CAT(qtile_, SFX)(qt, 5, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        case 4: CAT(qtile_, SFX)(qt, 4, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        case 3: CAT(qtile_, SFX)(qt, 3, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        case 2: CAT(qtile_, SFX)(qt, 2, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        default: CAT(qtile_, SFX)(qt, 1, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        }
                    } else { /* the last, ragged column tile */
                        CAT(qtile_, SFX)(qt, mr, nc, xm, K, wt, row_bytes, bt, ym, N);
                    }
                }
            }
        }
    }
}

/* Thread tid of nth's rows of out[i, :] = dequantized row ids[i] of W [*, K] (the embedding
   lookup; ids checked by the caller). */
static inline __attribute__((always_inline)) void CAT(qrows_, SFX)(const int qt, const uint8_t* w,
                                                                   const int64_t* ids, const int64_t n,
                                                                   const int64_t K, ELEM* out, const int tid,
                                                                   const int nth) {
    const int64_t row_bytes = K / QK / block_chunks(qt) * block_bytes(qt);
    for (int64_t i = n * tid / nth; i < n * (tid + 1) / nth; ++i) {
        const uint8_t* row = w + ids[i] * row_bytes;
        ELEM* o = out + i * K;
        for (int64_t j = 0; j < K / QK; ++j) {
            v16 w0, w1;
            dequant_block(qt, row, j, &w0, &w1);
            CAT(st16_, SFX)(o + j * QK, w0);
            CAT(st16_, SFX)(o + j * QK + 16, w1);
        }
    }
}

/* ---- int8 activations (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) ---------------------------------------- */

/* Block xb (32 elements of x) quantized as below: q (natural order) and, with planes = 2, the
   residual plane q2; returns d and sets *s = sum(q), *t = sum(q2) (0 for one plane).
   A block holding a NaN returns d = NaN (vmax alone would skip it) and one holding an infinity
   d = inf, both with q = q2 = 0: the row's outputs are then NaN (0 times a NaN / inf scale), as
   the float kernels' NaN in, NaN out, not finite values of int8 conversions of NaN (INT_MIN) summed
   into a wrapped (undefined) int. A subnormal d (max|x| below 127 * 2^-126: 1 / d overflows)
   leaves q = 0 too, the block then counting as zero (its terms are below 2^-119 |w|). */
static inline __attribute__((always_inline)) float
CAT(act8_quant_block_, SFX)(const int planes, const ELEM* xb, int8_t q[QK], int8_t q2[QK], int* s, int* t) {
    const v16 a = CAT(ld16_, SFX)(xb), b = CAT(ld16_, SFX)(xb + 16);
    const v16i nan = (a != a) | (b != b);
    int any_nan = 0;
    for (int i = 0; i < 16; ++i) any_nan |= nan[i];
    const float d = any_nan ? __builtin_nanf("") : hmax16(vmax(vabs16(a), vabs16(b))) / 127.0f;
    /* normal and finite only (NaN compares false): else q = 0 (a * 0 is NaN for NaN / inf a) */
    if (!(d >= 0x1p-126f && d <= 0x1p127f)) {
        memset(q, 0, QK);
        if (planes == 2) memset(q2, 0, QK);
        *s = *t = 0;
        return d;
    }
    const float id = 1.0f / d;
    const v16i qa = rint16_i32(a * id), qb = rint16_i32(b * id);
    int sum = 0;
    for (int i = 0; i < 16; ++i) {
        q[i] = (int8_t)qa[i];
        q[i + 16] = (int8_t)qb[i];
        sum += qa[i] + qb[i];
    }
    *s = sum;
    *t = 0;
    if (planes == 2) {
        /* residuals in float32 (exact enough: |r| <= d / 2 up to rounding), then clamped: a
           rounding at the edge must not wrap an int8 */
        const v16 ra = a - __builtin_convertvector(qa, v16) * d;
        const v16 rb = b - __builtin_convertvector(qb, v16) * d;
        const v16i ua = rint16_i32(ra * (id * 254.0f)), ub = rint16_i32(rb * (id * 254.0f));
        int tt = 0;
        for (int i = 0; i < 16; ++i) {
            const int va = ua[i] > 127 ? 127 : ua[i] < -127 ? -127 : ua[i];
            const int vb = ub[i] > 127 ? 127 : ub[i] < -127 ? -127 : ub[i];
            q2[i] = (int8_t)va;
            q2[i + 16] = (int8_t)vb;
            tt += va + vb;
        }
        *t = tt;
    }
    return d;
}

/* One row of x (K floats) quantized per 32-block j as llama.cpp's Q8 activations, with a float32
   scale: d = max|x| / 127, q = rint(x * (1 / d)) (nearest even; q = 0 when d = 0, subnormal or
   not finite: NaN for a block with a NaN, inf with an infinity), s = sum(q).
   With planes = 2 (the act16 kernels) the rounding residual r = x - d q is quantized again on
   the finer step d / 254 (q2 = rint(r * 254 / d), |q2| <= 127 as |r| <= d / 2), so
   x ~= d (q + q2 / 254) to within d / 508 (~2^-16 of the block's largest |x|), and
   s = sum(q) + sum(q2) / 254. Written to `out` (act8_row_bytes(K, planes)): per pair p of blocks
   the 64 quants of plane 0 in the pair layout (quant_dot8.h; the blocks past the end zero), then
   those of plane 1, then 16 lanes of d per pair (d of the block the lane belongs to), then 16
   lanes of c = OFF' * d * s / 8 (a block's 8 lanes sum to OFF' d s; OFF' = 1 for Q4_1, whose
   minimum multiplies d s, else the pair layout's OFF). */
static inline __attribute__((always_inline)) void
CAT(act8_quant_row_, SFX)(const int qt, const int planes, const ELEM* x, const int64_t K, uint8_t* out) {
    const int64_t nb = K / QK, np = (nb + 1) / 2;
    int8_t* xq = (int8_t*)out;
    float* dx = (float*)(out + np * 64 * planes);
    float* xc = dx + np * 16;
    const float off = qt == QT_Q4_1 || qt == QT_Q4_K ? 1.0f : (float)dot8_offset(qt);
    for (int64_t p = 0; p < np; ++p) {
        for (int h = 0; h < 2; ++h) {
            const int64_t j = 2 * p + h;
            int8_t* q = xq + p * 64;
            int8_t* q2 = xq + np * 64 + p * 64;
            float d = 0.0f, c = 0.0f;
            if (j < nb) {
                int8_t bq[QK], bq2[QK];
                int s, t;
                d = CAT(act8_quant_block_, SFX)(planes, x + j * QK, bq, bq2, &s, &t);
                for (int i = 0; i < QK; ++i) q[dot8_pos(qt, h, i)] = bq[i];
                float s2 = 0.0f;
                if (planes == 2) {
                    for (int i = 0; i < QK; ++i) q2[dot8_pos(qt, h, i)] = bq2[i];
                    s2 = (float)t * (1.0f / 254.0f);
                }
                c = off * ((float)s + s2) * d * 0.125f;
                if (qt == QT_Q6_K) { /* per 16 (the weight's sub-scales): 32 d sum / 4 per lane */
                    for (int g = 0; g < 2; ++g) {
                        int sg = 0, tg = 0;
                        for (int i = 16 * g; i < 16 * g + 16; ++i) {
                            sg += bq[i];
                            tg += planes == 2 ? bq2[i] : 0;
                        }
                        const float cg = 32.0f * ((float)sg + (float)tg * (1.0f / 254.0f)) * d * 0.25f;
                        for (int l = 0; l < 4; ++l) xc[p * 16 + 8 * h + 4 * g + l] = cg;
                    }
                }
            } else {
                for (int i = 0; i < 32; ++i) q[dot8_pos(qt, h, i)] = 0;
                if (planes == 2)
                    for (int i = 0; i < 32; ++i) q2[dot8_pos(qt, h, i)] = 0;
            }
            for (int l = 0; l < 16; ++l)
                if (dot8_lane_hi(qt, l) == h) {
                    dx[p * 16 + l] = d;
                    if (qt != QT_Q6_K || j >= nb) xc[p * 16 + l] = c;
                }
        }
    }
}

/* Pair p of blocks (`two`: whether block 2p + 1 exists) of nc weight rows into the mr x nc
   accumulators: per lane acc += d_w (d_x dot8 - c) (Q4_0, Q8_0, Q6_K) or d_w d_x dot8 + m c (Q4_1,
   Q4_K), with dot8 = dot8(plane 0) + dot8(plane 1) / 254 for two planes. K-quants: ki = p % 4 (a
   literal at the call site, so the pair's shifts and lane picks are constants) and ksv the nc rows'
   kscales of the superblock; unused otherwise. */
static inline __attribute__((always_inline)) void
CAT(qpair8_, SFX)(const int qt, const int planes, const int mr, const int nc, const int64_t p, const int ki,
                  const int two, const uint8_t* xa, const int64_t xstride, const int64_t np, const uint8_t* w,
                  const int64_t row_bytes, v16i hi, const v16 ksv[NC8], v16 acc[MR8][NC8]) {
    const int64_t bb = block_bytes(qt);
    const int qoff = qt == QT_Q4_1 ? 4 : 2;
#pragma GCC unroll 4
    for (int c = 0; c < nc; ++c) {
        wpair wp;
        v16 dw, mw;
        if (qt >= QT_Q4_K) { /* pair ki = p & 3 of superblock p / 4, its scales in ksv (quant_dot8_k.h) */
            wp = load_kpair(qt, w + c * row_bytes + (p >> 2) * bb, ki);
            kpair_scales(qt, ksv[c], ki, &dw, &mw);
        } else {
            const uint8_t* b = w + c * row_bytes + 2 * p * bb;
            wp = load_pair(qt, b + qoff, b + bb + qoff, two);
            pair_scales(qt, b, bb, two, hi, &dw, &mw);
        }
#pragma GCC unroll 4
        for (int r = 0; r < mr; ++r) {
            const uint8_t* xr = xa + r * xstride;
            const v16 dx = *(const v16*)(xr + np * 64 * planes + p * 64);
            const v16 xc = *(const v16*)(xr + np * 64 * (planes + 1) + p * 64);
            v16 t = __builtin_convertvector(dot8(qt, wp, (const int8_t*)(xr + p * 64)), v16);
            if (planes == 2)
                t += __builtin_convertvector(dot8(qt, wp, (const int8_t*)(xr + np * 64 + p * 64)), v16) *
                    (1.0f / 254.0f);
            t *= dx;
            if (qt == QT_Q4_1 || qt == QT_Q4_K) acc[r][c] += dw * t + mw * xc;
            else acc[r][c] += dw * (t - xc);
        }
    }
}

/* mr (<= MR8) quantized rows (xa, xstride bytes apart) times nc (<= NC8) weight rows. */
static inline __attribute__((always_inline)) void
CAT(qtile8_, SFX)(const int qt, const int planes, const int mr, const int nc, const uint8_t* xa,
                  const int64_t xstride, const int64_t K, const uint8_t* w, const int64_t row_bytes,
                  const ELEM* bias, ELEM* y, const int64_t ldy) {
    v16 acc[MR8][NC8];
#pragma GCC unroll 4
    for (int r = 0; r < MR8; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < NC8; ++c) acc[r][c] = (v16){};
    v16i hi;
    for (int l = 0; l < 16; ++l) hi[l] = dot8_lane_hi(qt, l) ? -1 : 0;
    const int64_t nb = K / QK, np = (nb + 1) / 2;
    v16 ksv[NC8];
    if (qt >= QT_Q4_K) { /* 4 pairs per superblock, unrolled so each pair's shifts are constants */
        for (int64_t p = 0; p < np; p += 4) {
#pragma GCC unroll 4
            for (int c = 0; c < nc; ++c) ksv[c] = kscales(qt, w + c * row_bytes + (p >> 2) * block_bytes(qt));
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i)
                CAT(qpair8_, SFX)(qt, planes, mr, nc, p + i, i, 1, xa, xstride, np, w, row_bytes, hi, ksv,
                                  acc);
        }
    } else {
        for (int64_t p = 0; p < nb / 2; ++p)
            CAT(qpair8_, SFX)(qt, planes, mr, nc, p, 0, 1, xa, xstride, np, w, row_bytes, hi, ksv, acc);
    }
    if (qt < QT_Q4_K && (nb & 1))
        CAT(qpair8_, SFX)(qt, planes, mr, nc, nb / 2, 0, 0, xa, xstride, np, w, row_bytes, hi, ksv, acc);
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < nc; ++c) {
            const float b = bias ? CAT(ld1_, SFX)(bias + c) : 0.0f;
            CAT(st1_, SFX)(y + r * ldy + c, hsum16(acc[r][c]) + b);
        }
}

/* Thread tid of nth's share of y = x @ W^T (+ bias) with x quantized to int8 first (`planes` int8
   planes; each thread its share of rows, into xa: M x act8_row_bytes(K, planes)), then the column
   tiles split as qgemm. */
static inline __attribute__((always_inline)) void
CAT(qgemm8_, SFX)(const int qt, const int planes, const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y,
                  const int64_t M, const int64_t N, const int64_t K, uint8_t* xa, const int tid,
                  const int nth) {
    const int64_t xs = act8_row_bytes(K, planes);
    for (int64_t r = M * tid / nth; r < M * (tid + 1) / nth; ++r)
        CAT(act8_quant_row_, SFX)(qt, planes, x + r * K, K, xa + r * xs);
#pragma omp barrier
    const int64_t row_bytes = K / QK / block_chunks(qt) * block_bytes(qt);
    const int64_t tiles = (N + NC8 - 1) / NC8;
    int64_t mc = ((int64_t)(1 << 17) / xs) / MR8 * MR8;
    if (mc < MR8) mc = MR8;
    const int64_t t_begin = tiles * tid / nth, t_end = tiles * (tid + 1) / nth;
    const int64_t pf_tiles = prefetch_tiles(NC8 * row_bytes);
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t m_end = m0 + mc < M ? m0 + mc : M;
        for (int64_t t = t_begin; t < t_end; ++t) {
            const int64_t n = t * NC8;
            const int nc = N - n < NC8 ? (int)(N - n) : NC8;
            const uint8_t* wt = w + n * row_bytes;
            const ELEM* bt = bias ? bias + n : NULL;
            if (m0 == 0) prefetch_tile(wt, NC8 * row_bytes, pf_tiles, t_end - t);
            for (int64_t m = m0; m < m_end; m += MR8) {
                const int mr = m_end - m < MR8 ? (int)(m_end - m) : MR8;
                const uint8_t* xm = xa + m * xs;
                ELEM* ym = y + m * N + n;
                if (nc == NC8) {
                    switch (mr) {
                    case 4: CAT(qtile8_, SFX)(qt, planes, 4, NC8, xm, xs, K, wt, row_bytes, bt, ym, N); break;
                    case 3: CAT(qtile8_, SFX)(qt, planes, 3, NC8, xm, xs, K, wt, row_bytes, bt, ym, N); break;
                    case 2: CAT(qtile8_, SFX)(qt, planes, 2, NC8, xm, xs, K, wt, row_bytes, bt, ym, N); break;
                    default:
                        CAT(qtile8_, SFX)(qt, planes, 1, NC8, xm, xs, K, wt, row_bytes, bt, ym, N);
                        break;
                    }
                } else {
                    CAT(qtile8_, SFX)(qt, planes, mr, nc, xm, xs, K, wt, row_bytes, bt, ym, N);
                }
            }
        }
    }
}

/* ---- int8 activations on the x4 layout (Q8_0; quant_x4.h) ------------------------------------ */

/* One row of x quantized for the x4 kernels (act8_quant_block's values) into `out`
   (x4_act_bytes(nb, planes): quants per plane, the vpdpbusd seeds per plane, then d_x). */
static inline __attribute__((always_inline)) void CAT(x4_quant_row_, SFX)(const int planes, const ELEM* x,
                                                                          const int64_t K, uint8_t* out) {
    const int64_t nb = K / QK;
    int8_t* q = (int8_t*)out;
    int32_t* seed = (int32_t*)(out + planes * nb * QK);
    float* dx = (float*)(out + 2 * planes * nb * QK);
    for (int64_t j = 0; j < nb; ++j) {
        int s, t;
        int8_t* q1 = q + j * QK;
        int8_t* q2 = planes == 2 ? q + (nb + j) * QK : q1; /* (one plane: never written) */
        dx[j] = CAT(act8_quant_block_, SFX)(planes, x + j * QK, q1, q2, &s, &t);
        if (planes == 2)
            for (int l = 0; l < 8; ++l)
                seed[(nb + j) * 8 + l] = -128 * (q2[4 * l] + q2[4 * l + 1] + q2[4 * l + 2] + q2[4 * l + 3]);
        for (int l = 0; l < 8; ++l)
            seed[j * 8 + l] = -128 * (q1[4 * l] + q1[4 * l + 1] + q1[4 * l + 2] + q1[4 * l + 3]);
    }
}

/* mr (<= X4_MR) quantized rows (xa, xs bytes apart) times one group of four weight rows (wq: its
   nb * 128 quant bytes, ws: its nb * 8 scale bytes): y[r * ldy + i] = x_r . w_i (+ b_i) for
   i < nc. pf: the quants of a later group to prefetch, two lines per block (NULL: none). */
static inline __attribute__((always_inline)) void
CAT(qtile_x4_, SFX)(const int planes, const int mr, const int nc, const uint8_t* xa, const int64_t xs,
                    const int64_t nb, const uint8_t* wq, const uint8_t* ws, const uint8_t* pf,
                    const ELEM* bias, ELEM* y, const int64_t ldy) {
    v16 acc[X4_MR][2];
#pragma GCC unroll 4
    for (int r = 0; r < X4_MR; ++r) acc[r][0] = acc[r][1] = (v16){};
    for (int64_t j = 0; j < nb; ++j) {
        if (pf) {
            __builtin_prefetch(pf + j * 128, 0, 3);
            __builtin_prefetch(pf + j * 128 + 64, 0, 3);
        }
        v16 sa, sb;
        x4_scales(ws + j * 8, &sa, &sb);
        const uint8_t* w = wq + j * 128;
#pragma GCC unroll 4
        for (int r = 0; r < mr; ++r) {
            const uint8_t* xr = xa + r * xs;
            const int8_t* q = (const int8_t*)xr + j * QK;
            const int32_t* seed = (const int32_t*)(xr + planes * nb * QK) + j * 8;
            const float dx = ((const float*)(xr + 2 * planes * nb * QK))[j];
            v16 ta = __builtin_convertvector(x4_dot2(w, q, seed), v16);
            v16 tb = __builtin_convertvector(x4_dot2(w + 64, q, seed), v16);
            if (planes == 2) {
                const int8_t* q2 = q + nb * QK;
                const int32_t* seed2 = seed + nb * 8;
                ta += __builtin_convertvector(x4_dot2(w, q2, seed2), v16) * (1.0f / 254.0f);
                tb += __builtin_convertvector(x4_dot2(w + 64, q2, seed2), v16) * (1.0f / 254.0f);
            }
            acc[r][0] += ta * (sa * dx);
            acc[r][1] += tb * (sb * dx);
        }
    }
    for (int r = 0; r < mr; ++r) {
        float out[4];
        x4_reduce(acc[r][0], acc[r][1], out);
        for (int i = 0; i < nc; ++i)
            CAT(st1_, SFX)(y + r * ldy + i, out[i] + (bias ? CAT(ld1_, SFX)(bias + i) : 0.0f));
    }
}

/* ---- int8 activations on the x4 layout of Q4_1 (quant_x4.h) --------------------------------- */

/* One row of x quantized for the Q4_1 x4 kernels (act8_quant_block's values) into `out`
   (x4_act_bytes(nb, planes): quants per plane, then d_x, then c = d_x (s + t / 254) / 4). */
static inline __attribute__((always_inline)) void CAT(x4q_quant_row_, SFX)(const int planes, const ELEM* x,
                                                                           const int64_t K, uint8_t* out) {
    const int64_t nb = K / QK;
    int8_t* q = (int8_t*)out;
    float* dx = (float*)(out + planes * nb * QK);
    float* cx = dx + nb;
    for (int64_t j = 0; j < nb; ++j) {
        int s, t;
        int8_t* q1 = q + j * QK;
        int8_t* q2 = planes == 2 ? q + (nb + j) * QK : q1; /* (one plane: never written) */
        const float d = CAT(act8_quant_block_, SFX)(planes, x + j * QK, q1, q2, &s, &t);
        dx[j] = d;
        cx[j] = d * ((float)s + (planes == 2 ? (float)t * (1.0f / 254.0f) : 0.0f)) * 0.25f;
    }
}

/* mr (<= X4_MR) quantized rows (xa, xs bytes apart) times one group of four Q4_1 weight rows
   (wq: its nb * 64 quant bytes, ws: its nb * 16 scale bytes): y[r * ldy + i] = x_r . w_i (+ b_i)
   for i < nc; per lane acc += d_w d_x dot + m_w c. pf: the quants of a later group to prefetch
   (NULL: none). */
static inline __attribute__((always_inline)) void
CAT(qtile_x4q_, SFX)(const int planes, const int mr, const int nc, const uint8_t* xa, const int64_t xs,
                     const int64_t nb, const uint8_t* wq, const uint8_t* ws, const uint8_t* pf,
                     const ELEM* bias, ELEM* y, const int64_t ldy) {
    v16 acc[X4_MR];
#pragma GCC unroll 4
    for (int r = 0; r < X4_MR; ++r) acc[r] = (v16){};
    for (int64_t j = 0; j < nb; ++j) {
        if (pf) __builtin_prefetch(pf + j * 64, 0, 3);
        v16 dw, mw;
        x4q_scales(ws + j * 16, &dw, &mw);
        const x4q_block b = x4q_unpack(wq + j * 64);
#pragma GCC unroll 4
        for (int r = 0; r < mr; ++r) {
            const uint8_t* xr = xa + r * xs;
            const float* dx = (const float*)(xr + planes * nb * QK);
            v16 t = __builtin_convertvector(x4q_dot(&b, (const int8_t*)xr + j * QK), v16);
            if (planes == 2)
                t += __builtin_convertvector(x4q_dot(&b, (const int8_t*)xr + (nb + j) * QK), v16) *
                    (1.0f / 254.0f);
            acc[r] += t * (dw * dx[j]);
            acc[r] += mw * dx[nb + j];
        }
    }
    for (int r = 0; r < mr; ++r) {
        float out[4];
        x4q_reduce(acc[r], out);
        for (int i = 0; i < nc; ++i)
            CAT(st1_, SFX)(y + r * ldy + i, out[i] + (bias ? CAT(ld1_, SFX)(bias + i) : 0.0f));
    }
}

/* The per-type parts of qgemm_x4_drive (q41: a compile-time constant, so each branch folds away). */
#define X4_QUANT_ROW(r)                                                                                      \
    (q41 ? CAT(x4q_quant_row_, SFX)(planes, x + (r) * K, K, xa + (r) * xs)                                   \
         : CAT(x4_quant_row_, SFX)(planes, x + (r) * K, K, xa + (r) * xs))
#define X4_TILE(MR)                                                                                          \
    (q41 ? CAT(qtile_x4q_, SFX)(planes, MR, nc, xm, xs, nb, wq, ws, pf, bg, ym, N)                           \
         : CAT(qtile_x4_, SFX)(planes, MR, nc, xm, xs, nb, wq, ws, pf, bg, ym, N))
/* Thread tid of nth's share of y = x @ W^T (+ bias) for W [N, K] in the x4 layout: x quantized
   first into xa (M x x4_act_bytes): with `own` (few rows) every thread quantizes all rows into its
   own xa, which costs less than the barrier it saves (~18 blocks a row at K = 576), else each
   its share of rows into a shared xa, then a barrier. Then the threads split the groups of four
   weight rows; per group every 4-row tile of x passes over its weights (~2.4 KB for K = 576:
   they stay in L1), the weights of the group ~x4_prefetch_bytes ahead prefetched during the
   first tile. */
static inline __attribute__((always_inline)) void
CAT(qgemm_x4_drive_, SFX)(const int q41, const int planes, const int own, const ELEM* x, const uint8_t* w,
                          const ELEM* bias, ELEM* y, const int64_t M, const int64_t N, const int64_t K,
                          uint8_t* xa, const int tid, const int nth) {
    const int64_t nb = K / QK, xs = x4_act_bytes(nb, planes);
    if (own) {
        for (int64_t r = 0; r < M; ++r) X4_QUANT_ROW(r);
    } else {
        for (int64_t r = M * tid / nth; r < M * (tid + 1) / nth; ++r) X4_QUANT_ROW(r);
#pragma omp barrier
    }
    const int64_t G = (N + X4_ROWS - 1) / X4_ROWS, gq = nb * (q41 ? 64 : 128), gs = nb * (q41 ? 16 : 8);
    const uint8_t* scales = w + G * gq;
    const int64_t g_begin = G * tid / nth, g_end = G * (tid + 1) / nth;
    const int64_t pfb = x4_prefetch_bytes;
    const int64_t ahead = pfb <= 0 ? INT64_MAX : (pfb / (gq + gs) > 0 ? pfb / (gq + gs) : 1);
    for (int64_t g = g_begin; g < g_end; ++g) {
        const int64_t n = g * X4_ROWS;
        const int nc = N - n < X4_ROWS ? (int)(N - n) : X4_ROWS;
        const uint8_t* wq = w + g * gq;
        const uint8_t* ws = scales + g * gs;
        const uint8_t* pf = ahead < g_end - g ? wq + ahead * gq : NULL;
        if (pf)
            for (int64_t o = 0; o < gs; o += 64) __builtin_prefetch(ws + ahead * gs + o, 0, 3);
        const ELEM* bg = bias ? bias + n : NULL;
        for (int64_t m = 0; m < M; m += X4_MR) {
            const uint8_t* xm = xa + m * xs;
            ELEM* ym = y + m * N + n;
            switch (M - m < X4_MR ? (int)(M - m) : X4_MR) {
            case 4: X4_TILE(4); break;
            case 3: X4_TILE(3); break;
            case 2: X4_TILE(2); break;
            default: X4_TILE(1); break;
            }
            pf = NULL; /* the first tile brought the later group in */
        }
    }
}
#undef X4_QUANT_ROW
#undef X4_TILE

/* qgemm_x4_drive on a Q8_0 (qgemm_x4_) or a Q4_1 (qgemm_x4q_) weight in its x4 layout. */
static inline __attribute__((always_inline)) void
CAT(qgemm_x4_, SFX)(const int planes, const int own, const ELEM* x, const uint8_t* w, const ELEM* bias,
                    ELEM* y, const int64_t M, const int64_t N, const int64_t K, uint8_t* xa, const int tid,
                    const int nth) {
    CAT(qgemm_x4_drive_, SFX)(0, planes, own, x, w, bias, y, M, N, K, xa, tid, nth);
}
static inline __attribute__((always_inline)) void
CAT(qgemm_x4q_, SFX)(const int planes, const int own, const ELEM* x, const uint8_t* w, const ELEM* bias,
                     ELEM* y, const int64_t M, const int64_t N, const int64_t K, uint8_t* xa, const int tid,
                     const int nth) {
    CAT(qgemm_x4_drive_, SFX)(1, planes, own, x, w, bias, y, M, N, K, xa, tid, nth);
}

/* ---- large batch: a dequantized float32 panel and an outer-product micro-kernel ---------------- */

/* Columns n0 .. n0 + ncols - 1 (ncols <= PW) of W dequantized into buf [K, PW] (the PW weights of
   one input feature contiguous, columns past ncols zero): per 16 columns and 32-chunk, the
   16 x 32 weights dequantized as rows and turned into 32 rows of 16 columns by two 16 x 16
   register transposes. W: GGUF rows row_bytes apart, or with x4 a Q4_1 weight in the x4 layout
   of G groups (quant_x4.h). */
static inline __attribute__((always_inline)) void
CAT(qpanel_dequant_, SFX)(const int qt, const int x4, const uint8_t* w, const int64_t row_bytes,
                          const int64_t n0, const int64_t G, const int ncols, const int64_t K, float* buf) {
    for (int g = 0; g < PW / 16; ++g) {
        for (int64_t j = 0; j < K / QK; ++j) {
            v16 a[16], b[16];
            for (int i = 0; i < 16; ++i) {
                if (g * 16 + i < ncols) {
                    if (x4) x4q_dequant(w, G, K / QK, n0 + g * 16 + i, j, &a[i], &b[i]);
                    else dequant_block(qt, w + (n0 + g * 16 + i) * row_bytes, j, &a[i], &b[i]);
                } else {
                    a[i] = (v16){};
                    b[i] = (v16){};
                }
            }
            transpose16(a);
            transpose16(b);
            float* o = buf + j * QK * PW + g * 16;
            for (int i = 0; i < 16; ++i) {
                *(v16*)(o + i * PW) = a[i];
                *(v16*)(o + (i + 16) * PW) = b[i];
            }
        }
    }
}

/* mr (<= 8) rows of float32 x times a [K, PW] panel: 8 x 3 accumulator vectors, per input
   feature 3 weight vectors and one broadcast x value per row. */
static inline __attribute__((always_inline)) void CAT(pkernel_, SFX)(const int mr, const int64_t K,
                                                                     const float* x, const float* wp,
                                                                     const ELEM* bias, ELEM* y,
                                                                     const int64_t ldy, const int ncols) {
    v16 a0[8], a1[8], a2[8];
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) a0[r] = a1[r] = a2[r] = (v16){};
    for (int64_t k = 0; k < K; ++k) {
        const float* wk = wp + k * PW;
        const v16 w0 = *(const v16*)wk, w1 = *(const v16*)(wk + 16), w2 = *(const v16*)(wk + 32);
#pragma GCC unroll 8
        for (int r = 0; r < mr; ++r) {
            const float xv = x[r * K + k];
            a0[r] += xv * w0;
            a1[r] += xv * w1;
            a2[r] += xv * w2;
        }
    }
    float bb[PW] = {0};
    if (bias)
        for (int j = 0; j < ncols; ++j) bb[j] = CAT(ld1_, SFX)(bias + j);
    const v16 b0 = *(const v16*)bb, b1 = *(const v16*)(bb + 16), b2 = *(const v16*)(bb + 32);
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) {
        ELEM t[PW];
        ELEM* o = ncols == PW ? y + r * ldy : t;
        CAT(st16_, SFX)(o, a0[r] + b0);
        CAT(st16_, SFX)(o + 16, a1[r] + b1);
        CAT(st16_, SFX)(o + 32, a2[r] + b2);
        if (ncols != PW) memcpy(y + r * ldy, t, ncols * sizeof(ELEM));
    }
}

/* Thread tid of nth's share of y = x @ W^T (+ bias) through dequantized panels: xf is x as
   float32 (x itself for float32, else filled here by all threads), buf the thread's [K, PW]
   panel. The threads split the panels; rows go in chunks of ~256 KB of xf, and a panel is
   dequantized once per chunk (so once per call up to 256 KB / 4K rows). */
static inline __attribute__((always_inline)) void
CAT(qpanel_, SFX)(const int qt, const int x4, const ELEM* x, float* xf, const uint8_t* w, const ELEM* bias,
                  ELEM* y, const int64_t M, const int64_t N, const int64_t K, float* buf, const int tid,
                  const int nth) {
    if ((const void*)xf != (const void*)x) {
        for (int64_t i = M * K * tid / nth; i < M * K * (tid + 1) / nth; ++i) xf[i] = CAT(ld1_, SFX)(x + i);
#pragma omp barrier
    }
    if (!buf) return;
    const int64_t row_bytes = K / QK / block_chunks(qt) * block_bytes(qt);
    const int64_t P = (N + PW - 1) / PW;
    int64_t mc = K > 0 ? ((int64_t)(1 << 16) / K) & ~(int64_t)7 : 8;
    if (mc < 8) mc = 8;
    const int64_t p_begin = P * tid / nth, p_end = P * (tid + 1) / nth;
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t m_end = m0 + mc < M ? m0 + mc : M;
        for (int64_t p = p_begin; p < p_end; ++p) {
            const int ncols = N - p * PW < PW ? (int)(N - p * PW) : PW;
            CAT(qpanel_dequant_, SFX)(qt, x4, w, row_bytes, p * PW, (N + X4_ROWS - 1) / X4_ROWS, ncols, K,
                                      buf);
            const ELEM* bp = bias ? bias + p * PW : NULL;
            for (int64_t m = m0; m < m_end; m += 8) {
                const float* xm = xf + m * K;
                ELEM* ym = y + m * N + p * PW;
                switch (m_end - m < 8 ? (int)(m_end - m) : 8) {
                case 8: CAT(pkernel_, SFX)(8, K, xm, buf, bp, ym, N, ncols); break;
                case 7: CAT(pkernel_, SFX)(7, K, xm, buf, bp, ym, N, ncols); break;
                case 6: CAT(pkernel_, SFX)(6, K, xm, buf, bp, ym, N, ncols); break;
                case 5: CAT(pkernel_, SFX)(5, K, xm, buf, bp, ym, N, ncols); break;
                case 4: CAT(pkernel_, SFX)(4, K, xm, buf, bp, ym, N, ncols); break;
                case 3: CAT(pkernel_, SFX)(3, K, xm, buf, bp, ym, N, ncols); break;
                case 2: CAT(pkernel_, SFX)(2, K, xm, buf, bp, ym, N, ncols); break;
                default: CAT(pkernel_, SFX)(1, K, xm, buf, bp, ym, N, ncols); break;
                }
            }
        }
    }
}

/* The exported functions return 0, or -1 when a scratch buffer could not be allocated (nothing
   written to y then). */
#define QUANT_EXPORTS(NAME, QT)                                                                              \
    void CAT(quant_gemm_##NAME##_, SFX)(const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y,          \
                                        int64_t M, int64_t N, int64_t K, int nthreads) {                     \
        _Pragma("omp parallel num_threads(nthreads)")                                                        \
            CAT(qgemm_, SFX)(QT, x, w, bias, y, M, N, K, omp_get_thread_num(), omp_get_num_threads());       \
    }                                                                                                        \
    int CAT(quant_gemm_panel_##NAME##_, SFX)(const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y,     \
                                             int64_t M, int64_t N, int64_t K, int nthreads) {                \
        float* xf = sizeof(ELEM) == 4 ? (float*)(void*)x : (float*)scratch(2, (size_t)(M * K) * 4);          \
        if (sizeof(ELEM) != 4 && !xf) return -1; /* (float32 x: an empty one may be NULL) */                 \
        int failed = 0;                                                                                      \
        _Pragma("omp parallel num_threads(nthreads)") {                                                      \
            float* buf = (float*)scratch(1, (size_t)K * PW * 4);                                             \
            if (!buf) { _Pragma("omp atomic write") failed = 1; }                                            \
            CAT(qpanel_, SFX)(QT, 0, x, xf, w, bias, y, M, N, K, buf, omp_get_thread_num(),                  \
                              omp_get_num_threads());                                                        \
        }                                                                                                    \
        return failed ? -1 : 0;                                                                              \
    }                                                                                                        \
    void CAT(quant_rows_##NAME##_, SFX)(const uint8_t* w, const int64_t* ids, int64_t n, int64_t K,          \
                                        ELEM* out, int nthreads) {                                           \
        _Pragma("omp parallel num_threads(nthreads)")                                                        \
            CAT(qrows_, SFX)(QT, w, ids, n, K, out, omp_get_thread_num(), omp_get_num_threads());            \
    }
/* int8 activations (act8: one plane; act16: two, x ~= d (q + q2 / 254)): the 32-weight block types
   and the K-quants Q4_K / Q6_K (quant_dot8_k.h). */
#define ACT8_EXPORTS(NAME, QT, KIND, PLANES)                                                                 \
    int CAT(quant_gemm_##KIND##_##NAME##_, SFX)(const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y,  \
                                                int64_t M, int64_t N, int64_t K, int nthreads) {             \
        uint8_t* xa = (uint8_t*)scratch(0, (size_t)(M * act8_row_bytes(K, PLANES)));                         \
        if (!xa) return -1;                                                                                  \
        _Pragma("omp parallel num_threads(nthreads)") CAT(qgemm8_, SFX)(                                     \
            QT, PLANES, x, w, bias, y, M, N, K, xa, omp_get_thread_num(), omp_get_num_threads());            \
        return 0;                                                                                            \
    }
/* int8 activations on the x4 layout (act8x4: one plane, act16x4: two; Q8_0: qgemm_x4, Q4_1:
   qgemm_x4q). Up to X4_MR rows each thread quantizes x into its own scratch (`own`): a thread
   without memory then writes nothing, the others their share of y, and the call returns -1. */
#define X4_EXPORTS(KIND, NAME, GEMM, PLANES)                                                                 \
    int CAT(quant_gemm_##KIND##_##NAME##_, SFX)(const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y,  \
                                                int64_t M, int64_t N, int64_t K, int nthreads) {             \
        const size_t xbytes = (size_t)(M * x4_act_bytes(K / QK, PLANES));                                    \
        const int own = M <= X4_MR;                                                                          \
        uint8_t* shared = own ? NULL : (uint8_t*)scratch(0, xbytes);                                         \
        if (!own && !shared) return -1;                                                                      \
        int failed = 0;                                                                                      \
        _Pragma("omp parallel num_threads(nthreads)") {                                                      \
            uint8_t* xa = own ? (uint8_t*)scratch(0, xbytes) : shared;                                       \
            if (!xa) {                                                                                       \
                _Pragma("omp atomic write") failed = 1;                                                      \
            } else {                                                                                         \
                CAT(GEMM, SFX)(PLANES, own, x, w, bias, y, M, N, K, xa, omp_get_thread_num(),                \
                               omp_get_num_threads());                                                       \
            }                                                                                                \
        }                                                                                                    \
        return failed ? -1 : 0;                                                                              \
    }
QUANT_EXPORTS(q8_0, QT_Q8_0)
QUANT_EXPORTS(q4_0, QT_Q4_0)
QUANT_EXPORTS(q4_1, QT_Q4_1)
QUANT_EXPORTS(q4_k, QT_Q4_K)
QUANT_EXPORTS(q5_k, QT_Q5_K)
QUANT_EXPORTS(q6_k, QT_Q6_K)
ACT8_EXPORTS(q8_0, QT_Q8_0, act8, 1)
ACT8_EXPORTS(q4_0, QT_Q4_0, act8, 1)
ACT8_EXPORTS(q4_1, QT_Q4_1, act8, 1)
ACT8_EXPORTS(q8_0, QT_Q8_0, act16, 2)
ACT8_EXPORTS(q4_0, QT_Q4_0, act16, 2)
ACT8_EXPORTS(q4_1, QT_Q4_1, act16, 2)
ACT8_EXPORTS(q4_k, QT_Q4_K, act8, 1)
ACT8_EXPORTS(q6_k, QT_Q6_K, act8, 1)
ACT8_EXPORTS(q4_k, QT_Q4_K, act16, 2)
ACT8_EXPORTS(q6_k, QT_Q6_K, act16, 2)
X4_EXPORTS(act8x4, q8_0, qgemm_x4_, 1)
X4_EXPORTS(act16x4, q8_0, qgemm_x4_, 2)
X4_EXPORTS(act8x4, q4_1, qgemm_x4q_, 1)
X4_EXPORTS(act16x4, q4_1, qgemm_x4q_, 2)
/* The panels on a Q4_1 weight in the x4 layout (when only that copy is kept). */
int CAT(quant_gemm_panelx4_q4_1_, SFX)(const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y, int64_t M,
                                       int64_t N, int64_t K, int nthreads) {
    float* xf = sizeof(ELEM) == 4 ? (float*)(void*)x : (float*)scratch(2, (size_t)(M * K) * 4);
    if (sizeof(ELEM) != 4 && !xf) return -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float* buf = (float*)scratch(1, (size_t)K * PW * 4);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        CAT(qpanel_, SFX)(QT_Q4_1, 1, x, xf, w, bias, y, M, N, K, buf, omp_get_thread_num(),
                          omp_get_num_threads());
    }
    return failed ? -1 : 0;
}
#undef QUANT_EXPORTS
#undef ACT8_EXPORTS
#undef X4_EXPORTS

#include "quant_amx_dtype.h"
#include "quant_vnni_dtype.h"
