/* The dtype-generic kernels of ops.c: rms_norm, silu_and_mul, gelu_tanh_and_mul, rope_write_kv, written with ELEM (storage type) and SFX (symbol
   suffix): included once per dtype through kv_instantiate.h, hence no include guard. */
/* 1 / sqrt(mean(src[0..n)^2) + eps): the RMS step both RMSNorms share (float32 sums). */
static inline float CAT(inv_rms_, SFX)(const ELEM* src, int64_t n, float eps) {
    const int64_t n16 = n & ~(int64_t)15;
    v16 ss = (v16){};
    float tail = 0.0f;
    int64_t i = 0;
    for (; i < n16; i += 16) {
        v16 v = CAT(ld16_, SFX)(src + i);
        ss += v * v;
    }
    for (; i < n; ++i) {
        float v = CAT(ld1_, SFX)(src + i);
        tail += v * v;
    }
    return 1.0f / sqrtf((hsum16(ss) + tail) / (float)n + eps);
}

void CAT(rms_norm_, SFX)(const ELEM* x, ELEM* residual, const ELEM* w, ELEM* out, int64_t T, int64_t H,
                         float eps, int nthreads) {
    const int64_t H16 = H & ~(int64_t)15;
#pragma omp parallel for schedule(static) num_threads(T >= 128 ? nthreads : 1)
    for (int64_t t = 0; t < T; ++t) {
        const ELEM* xr = x + t * H;
        ELEM* rr = residual ? residual + t * H : NULL;
        ELEM* orow = out + t * H;
        /* s = x (+ residual, rounded to the storage dtype and written back as the new residual) */
        const ELEM* src = xr;
        if (rr) {
            int64_t i = 0;
            for (; i < H16; i += 16)
                CAT(st16_, SFX)(rr + i, CAT(ld16_, SFX)(xr + i) + CAT(ld16_, SFX)(rr + i));
            for (; i < H; ++i) CAT(st1_, SFX)(rr + i, CAT(ld1_, SFX)(xr + i) + CAT(ld1_, SFX)(rr + i));
            src = rr;
        }
        const float inv = CAT(inv_rms_, SFX)(src, H, eps);
        int64_t i;
        for (i = 0; i < H16; i += 16) {
            v16 n = CAT(round16_, SFX)(CAT(ld16_, SFX)(src + i) * inv);
            CAT(st16_, SFX)(orow + i, n * CAT(ld16_, SFX)(w + i));
        }
        for (; i < H; ++i) {
            v16 n = CAT(round16_, SFX)((v16){} + CAT(ld1_, SFX)(src + i) * inv);
            CAT(st1_, SFX)(orow + i, n[0] * CAT(ld1_, SFX)(w + i));
        }
    }
}

/* Gemma's RMSNorm over rows of D elements: row (t, g) at x + t * ldx + g * D, written to
   out + t * ldo + g * D (in place when out == x: each row is read whole before it is written).
   y = x / sqrt(mean(x^2) + eps) * w1 in float32 (w1 = 1 + weight, float32), rounded once to the
   storage dtype; with add (laid out as out) y = add + y, rounded again -- the numerics of
   transformers' Gemma3RMSNorm followed by the residual add in the model dtype. */
void CAT(offset_rms_norm_, SFX)(const ELEM* x, int64_t ldx, const float* w1, const ELEM* add, ELEM* out,
                                int64_t ldo, int64_t T, int64_t G, int64_t D, float eps, int nthreads) {
    const int64_t D16 = D & ~(int64_t)15, rows = T * G;
#pragma omp parallel for schedule(static) num_threads(rows >= 128 ? nthreads : 1)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = r / G, g = r % G;
        const ELEM* src = x + t * ldx + g * D;
        const ELEM* ar = add ? add + t * ldo + g * D : NULL;
        ELEM* orow = out + t * ldo + g * D;
        const float inv = CAT(inv_rms_, SFX)(src, D, eps);
        int64_t i;
        for (i = 0; i < D16; i += 16) {
            v16 y = CAT(ld16_, SFX)(src + i) * inv * ld16_f32(w1 + i);
            if (ar) y = CAT(round16_, SFX)(y) + CAT(ld16_, SFX)(ar + i);
            CAT(st16_, SFX)(orow + i, y);
        }
        for (; i < D; ++i) {
            v16 y = (v16){} + CAT(ld1_, SFX)(src + i) * inv * w1[i];
            if (ar) y = CAT(round16_, SFX)(y) + CAT(ld1_, SFX)(ar + i);
            CAT(st1_, SFX)(orow + i, y[0]);
        }
    }
}

void CAT(silu_and_mul_, SFX)(const ELEM* gu, ELEM* out, int64_t T, int64_t I, int nthreads) {
    const int64_t I16 = I & ~(int64_t)15;
#pragma omp parallel for schedule(static) num_threads(T >= 32 ? nthreads : 1)
    for (int64_t t = 0; t < T; ++t) {
        const ELEM* g = gu + t * 2 * I;
        const ELEM* u = g + I;
        ELEM* o = out + t * I;
        int64_t i = 0;
        for (; i < I16; i += 16) {
            v16 gv = CAT(ld16_, SFX)(g + i);
            v16 e = exp16(vmin((v16){} - gv, (v16){} + 88.0f));
            v16 s = gv / (1.0f + e);
            /* below -88 the clamped exp no longer cancels gv (silu(-3e38) came out -1.8): there
               silu is gv * e^gv, i.e. +-0 (NaN for -inf, as torch) */
            const v16i far = gv < -88.0f;
            s = (v16)(((v16i)s & ~far) | ((v16i)(gv * 0.0f) & far));
            s = CAT(round16_, SFX)(s);
            CAT(st16_, SFX)(o + i, s * CAT(ld16_, SFX)(u + i));
        }
        for (; i < I; ++i) {
            float gv = CAT(ld1_, SFX)(g + i);
            v16 s = CAT(round16_, SFX)((v16){} + gv / (1.0f + expf(-gv)));
            CAT(st1_, SFX)(o + i, s[0] * CAT(ld1_, SFX)(u + i));
        }
    }
}

/* gelu_tanh(gate) * up over a fused [T, 2 * I] gate/up projection (GeGLU, Shazeer 2020, with
   the tanh approximation of GELU, Hendrycks & Gimpel 2016), each product rounded like torch's
   gelu then mul. 0.5 x (1 + tanh(z)) is computed as x / (1 + exp(-2 z)), z = sqrt(2 / pi)
   (x + 0.044715 x^3): the same value without tanh's cancellation where tanh(z) is near -1. */
void CAT(gelu_tanh_and_mul_, SFX)(const ELEM* gu, ELEM* out, int64_t T, int64_t I, int nthreads) {
    const int64_t I16 = I & ~(int64_t)15;
    const float c = 0.7978845608028654f, c3 = 0.7978845608028654f * 0.044715f;
#pragma omp parallel for schedule(static) num_threads(T >= 32 ? nthreads : 1)
    for (int64_t t = 0; t < T; ++t) {
        const ELEM* g = gu + t * 2 * I;
        const ELEM* u = g + I;
        ELEM* o = out + t * I;
        int64_t i = 0;
        for (; i < I16; i += 16) {
            v16 x = CAT(ld16_, SFX)(g + i);
            v16 m2z = (v16){} - 2.0f * x * (c + c3 * x * x);
            v16 s = x / (1.0f + exp16(vmin(m2z, (v16){} + 88.0f)));
            /* past the clamp the result is x e^{2z}: +-0 (NaN for -inf, as torch) */
            const v16i far = m2z > 88.0f;
            s = (v16)(((v16i)s & ~far) | ((v16i)(x * 0.0f) & far));
            s = CAT(round16_, SFX)(s);
            CAT(st16_, SFX)(o + i, s * CAT(ld16_, SFX)(u + i));
        }
        for (; i < I; ++i) {
            float x = CAT(ld1_, SFX)(g + i);
            float m2z = -2.0f * x * (c + c3 * x * x);
            v16 s = CAT(round16_, SFX)((v16){} + (m2z > 88.0f ? x * 0.0f : x / (1.0f + expf(m2z))));
            CAT(st1_, SFX)(o + i, s[0] * CAT(ld1_, SFX)(u + i));
        }
    }
}

/* Rotary embedding (RoFormer, Su et al. 2021; rotate-half form) of the q and k heads of a fused
   qkv row, written to qk_out [T, H + KH, D]; the rotated k and the v heads also go straight
   into their cache slots (cache [2, KH, NBBS, D], slots [T]; skipped when cache is NULL).
   Per element, as the torch path: o1 = round(x1 cos) - x2 sin, o2 = round(x2 cos) + x1 sin. */
void CAT(rope_write_kv_, SFX)(const ELEM* qkv, const ELEM* cosb, const ELEM* sinb, ELEM* qk_out, ELEM* cache,
                              const int64_t* slots, int64_t T, int64_t H, int64_t KH, int64_t D, int64_t NBBS,
                              int nthreads) {
    const int64_t half = D / 2, half16 = half & ~(int64_t)15, row = (H + 2 * KH) * D;
#pragma omp parallel for schedule(static) num_threads(T >= 64 ? nthreads : 1)
    for (int64_t t = 0; t < T; ++t) {
        const ELEM* c = cosb + t * half;
        const ELEM* sn = sinb + t * half;
        for (int64_t hh = 0; hh < H + KH; ++hh) {
            const ELEM* x = qkv + t * row + hh * D;
            ELEM* o = qk_out + (t * (H + KH) + hh) * D;
            int64_t i = 0;
            for (; i < half16; i += 16) {
                v16 x1 = CAT(ld16_, SFX)(x + i), x2 = CAT(ld16_, SFX)(x + half + i);
                v16 cv = CAT(ld16_, SFX)(c + i), sv = CAT(ld16_, SFX)(sn + i);
                CAT(st16_, SFX)(o + i, CAT(round16_, SFX)(x1 * cv) - x2 * sv);
                CAT(st16_, SFX)(o + half + i, CAT(round16_, SFX)(x2 * cv) + x1 * sv);
            }
            for (; i < half; ++i) {
                float x1 = CAT(ld1_, SFX)(x + i), x2 = CAT(ld1_, SFX)(x + half + i);
                float cv = CAT(ld1_, SFX)(c + i), sv = CAT(ld1_, SFX)(sn + i);
                v16 a = CAT(round16_, SFX)((v16){} + x1 * cv), b = CAT(round16_, SFX)((v16){} + x2 * cv);
                CAT(st1_, SFX)(o + i, a[0] - x2 * sv);
                CAT(st1_, SFX)(o + half + i, b[0] + x1 * sv);
            }
            if (cache && hh >= H) memcpy(cache + ((hh - H) * NBBS + slots[t]) * D, o, sizeof(ELEM) * D);
        }
        if (cache)
            for (int64_t h = 0; h < KH; ++h)
                memcpy(cache + ((KH + h) * NBBS + slots[t]) * D, qkv + t * row + (H + KH + h) * D,
                       sizeof(ELEM) * D);
    }
}

/* rope_write_kv for an int8 KV cache (cache: int8 bytes [2, KH, NBBS, D + 2], rows of codes and
   a float16 scale, kv_q8.h): the rotary pass above without a cache, then each token's rotated k
   (as stored in qk_out, rounded to ELEM) and v quantized into its slots by q8_quantize_row_i8,
   the rows kv_quant.quantize makes from the same values. D <= 256. */
void CAT(rope_write_kv_q8_, SFX)(const ELEM* qkv, const ELEM* cosb, const ELEM* sinb, ELEM* qk_out,
                                 int8_t* cache, const int64_t* slots, int64_t T, int64_t H, int64_t KH,
                                 int64_t D, int64_t NBBS, int nthreads) {
    CAT(rope_write_kv_, SFX)(qkv, cosb, sinb, qk_out, NULL, slots, T, H, KH, D, NBBS, nthreads);
    if (!cache) return;
    const int64_t row = (H + 2 * KH) * D, W = D + 2;
#pragma omp parallel for schedule(static) num_threads(T >= 64 ? nthreads : 1)
    for (int64_t t = 0; t < T; ++t) {
        float x[256];
        for (int64_t s = 0; s < 2; ++s)
            for (int64_t h = 0; h < KH; ++h) {
                const ELEM* src =
                    s == 0 ? qk_out + (t * (H + KH) + H + h) * D : qkv + t * row + (H + KH + h) * D;
                for (int64_t i = 0; i < D; ++i) x[i] = CAT(ld1_, SFX)(src + i);
                q8_quantize_row_i8(x, D, cache + ((s * KH + h) * NBBS + slots[t]) * W);
            }
    }
}
