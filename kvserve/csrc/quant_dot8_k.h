/* The K-quants Q4_K and Q6_K on the int8-activation kernels (quant_gemm.c, 2.): pair i (0-3) of a
   256-weight superblock, its 32-weight chunks 2i and 2i + 1, as the 64 unsigned bytes dot8
   multiplies (quant_dot8.h, natural pair layout: lanes 0-7 chunk 2i, 8-15 chunk 2i + 1) and the
   per-lane float scales that turn dot8's lanes into weights times activations. Part of
   quant_gemm.c (uses its K-quant layout helpers k4_codes, q6k_chunk, scale_min_k4).

   Q4_K: u = the 4-bit code (0..15), w = d sc_j u - dmin m_j, so per chunk j
     x . w = d sc_j d_x dot(u, q_x) - dmin m_j d_x sum(q_x):
   dw = d sc_j and mw = -dmin m_j per lane, the activation side c = d_x sum(q_x) / 8 as Q4_1's
   (quant_gemm_dtype.h's act8_quant_row); the kernel adds dw d_x dot8 + mw c.
   Q6_K: u = the 6-bit code (0..63), w = d sc_i (u - 32) with a scale per 16 weights (4 lanes),
   so per 16-weight sub-block i x . w = d sc_i (d_x dot(u, q_x) - 32 d_x sum(q_x)): dw = d sc_i
   per lane, c = 32 d_x sum(q_x of the lane's 16 weights) / 4 (the activation scale is per 32,
   the sum per 16); the kernel adds dw (d_x dot8 - c).

   int32 bounds: a dot8 lane sums 4 products u q_x, |q_x| <= 127, so |lane| <= 4 * 15 * 127 = 7620
   (Q4_K) or 4 * 63 * 127 = 32004 (Q6_K) per pair, converted to float32 at once (exact: < 2^24);
   AVX2's maddubs adds 2 products into int16: <= 2 * 63 * 127 = 16002 < 32767, never saturating;
   the scalar variant keeps u in int8 (<= 63). */
#ifndef KV_QUANT_DOT8_K_H
#define KV_QUANT_DOT8_K_H

/* The 64 codes of pair i of Q4_K superblock b: chunk 2i is the low nibbles of 32 bytes, chunk
   2i + 1 their high nibbles. */
static inline __attribute__((always_inline)) wpair load_kpair_q4(const uint8_t* b, const int i) {
    const uint8_t* qs = k4_codes(QT_Q4_K, b, 2 * i);
#if DOT8_ISA == 2
    const __m256i a = _mm256_loadu_si256((const __m256i*)qs);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), _mm256_srli_epi16(a, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
#elif DOT8_ISA == 1
    const __m256i a = _mm256_loadu_si256((const __m256i*)qs), m = _mm256_set1_epi8(0x0F);
    wpair p;
    p.a = _mm256_and_si256(a, m);
    p.b = _mm256_and_si256(_mm256_srli_epi16(a, 4), m);
    return p;
#else
    wpair p;
    for (int l = 0; l < 32; ++l) {
        p.v[l] = (int8_t)(qs[l] & 15);
        p.v[32 + l] = (int8_t)(qs[l] >> 4);
    }
    return p;
#endif
}

/* The 64 codes of pair i of Q6_K superblock b: both chunks take their low 4 bits from the same
   nibble (sl) of 64 consecutive ql bytes and their high 2 bits from neighbouring bit pairs (sh,
   sh + 2) of the same 32 qh bytes. */
static inline __attribute__((always_inline)) wpair load_kpair_q6(const uint8_t* b, const int i) {
    const uint8_t *ql, *qh;
    const int8_t* sc;
    int sl, sh;
    q6k_chunk(b, 2 * i, &ql, &qh, &sc, &sl, &sh);
    (void)sc;
#if DOT8_ISA == 2
    const __m512i lo = _mm512_and_si512(
        _mm512_srl_epi16(_mm512_loadu_si512((const void*)ql), _mm_cvtsi32_si128(sl)), _mm512_set1_epi8(0x0F));
    const __m256i h = _mm256_loadu_si256((const __m256i*)qh);
    const __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srl_epi16(h, _mm_cvtsi32_si128(sh))),
                                          _mm256_srl_epi16(h, _mm_cvtsi32_si128(sh + 2)), 1);
    /* (hh & 3) << 4 in one step: bits 4-5 after the left shift, nothing crosses a byte */
    return _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(hh, 4), _mm512_set1_epi8(0x30)));
#elif DOT8_ISA == 1
    const __m256i m = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    const __m128i csl = _mm_cvtsi32_si128(sl);
    const __m256i h = _mm256_loadu_si256((const __m256i*)qh);
    wpair p;
    p.a = _mm256_or_si256(
        _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i*)ql), csl), m),
        _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(h, _mm_cvtsi32_si128(sh)), 4), m2));
    p.b = _mm256_or_si256(
        _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i*)(ql + 32)), csl), m),
        _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(h, _mm_cvtsi32_si128(sh + 2)), 4), m2));
    return p;
#else
    wpair p;
    for (int l = 0; l < 32; ++l) {
        p.v[l] = (int8_t)(((ql[l] >> sl) & 15) | ((qh[l] >> sh) & 3) << 4);
        p.v[32 + l] = (int8_t)(((ql[32 + l] >> sl) & 15) | ((qh[l] >> (sh + 2)) & 3) << 4);
    }
    return p;
#endif
}

/* The scales of superblock b (type qt) as one float vector, computed once per superblock and
   weight row (the pairs pick their lanes with kpair_scales): Q4_K lanes 0-7 d sc_j, 8-15
   -dmin m_j (j = 0..7); Q6_K lane i d sc_i (i = 0..15, one per 16 weights). */
static inline __attribute__((always_inline)) v16 kscales(const int qt, const uint8_t* b) {
    if (qt == QT_Q6_K) return __builtin_convertvector(widen_s8(b + 192), v16) * fp16_to_f32(b + 208);
#if defined(__AVX512F__) && defined(__F16C__)
    /* The 12 packed bytes s0..s11 (b + 4) in one 16-byte vector, all 16 six-bit values at once
       (scale_min_k4's bit positions): sc_0..3 = s0..3 & 63, m_0..3 = s4..7 & 63,
       sc_4..7 = (s8..11 & 15) | (s0..3 >> 6) << 4, m_4..7 = (s8..11 >> 4) | (s4..7 >> 6) << 4.
       P holds per output byte the byte with the low bits, T the one with the top 2 bits. */
    const __m128i v = _mm_loadu_si128((const __m128i*)b); /* d, dmin, s0..s11 */
    const __m128i P =
        _mm_shuffle_epi8(v, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m128i T = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 0, 0, 0, 4, 5, 6, 7, 0, 0, 0, 0, 8, 9, 10, 11));
    const __m128i lo6 = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
    const __m128i hi4 = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
    const __m128i top = _mm_setr_epi8(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48);
    const __m128i u =
        _mm_or_si128(_mm_or_si128(_mm_and_si128(P, lo6), _mm_and_si128(_mm_srli_epi16(P, 4), hi4)),
                     _mm_and_si128(_mm_srli_epi16(T, 2), top)); /* bits 6-7 -> 4-5 */
    const __m512 dd = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                            _mm512_castps128_ps512(_mm_cvtph_ps(v)));
    const v16 sign = {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u)) * (v16)dd * sign;
#else
    const float d = fp16_to_f32(b), m = -fp16_to_f32(b + 2);
    v16 r;
    for (int j = 0; j < 8; ++j) {
        int sc, mn;
        scale_min_k4(j, b + 4, &sc, &mn);
        r[j] = d * (float)sc;
        r[8 + j] = m * (float)mn;
    }
    return r;
#endif
}

/* Pair i's per-lane scale dw and (Q4_K) minimum mw from the superblock's kscales vector sv, the
   natural pair layout's lanes: Q4_K dw = d sc of chunk 2i (lanes 0-7) / 2i + 1 (8-15), mw the
   negated minima likewise; Q6_K dw = d sc_(4i + l / 4) (the pair's four 16-weight sub-blocks),
   mw unused. */
static inline __attribute__((always_inline)) void kpair_scales(const int qt, const v16 sv, const int i,
                                                               v16* dw, v16* mw) {
    v16i idx;
    for (int l = 0; l < 16; ++l) idx[l] = qt == QT_Q6_K ? 4 * i + (l >> 2) : 2 * i + (l >> 3);
    *dw = __builtin_shuffle(sv, idx);
    if (qt == QT_Q6_K) {
        *mw = (v16){};
    } else {
        *mw = __builtin_shuffle(sv, idx + 8);
    }
}

/* Pair i of superblock b (type qt: Q4_K or Q6_K) as dot8's bytes. */
static inline __attribute__((always_inline)) wpair load_kpair(const int qt, const uint8_t* b, const int i) {
    return qt == QT_Q6_K ? load_kpair_q6(b, i) : load_kpair_q4(b, i);
}

#endif /* KV_QUANT_DOT8_K_H */
