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

/* Pair i of superblock b (type qt: Q4_K or Q6_K) as dot8's bytes, with its per-lane scales dw and
   (Q4_K) minima mw as in the header comment; hi: the lanes of chunk 2i + 1. */
static inline __attribute__((always_inline)) wpair load_kpair(const int qt, const uint8_t* b, const int i,
                                                              const v16i hi, v16* dw, v16* mw) {
    if (qt == QT_Q6_K) {
        const uint8_t *ql, *qh;
        const int8_t* sc;
        int sl, sh;
        q6k_chunk(b, 2 * i, &ql, &qh, &sc, &sl, &sh); /* sc[0..3]: chunk 2i's two, then 2i + 1's */
        const float d = fp16_to_f32(b + 208);
#if defined(__AVX512F__)
        int32_t s4;
        memcpy(&s4, sc, 4);
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_cvtsi32_si128(s4)));
        const __m512i quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0); /* lane / 4 */
        *dw = (v16)_mm512_permutexvar_ps(quad, f) * d;
#else
        v16 s;
        for (int l = 0; l < 16; ++l) s[l] = (float)sc[l >> 2];
        *dw = s * d;
#endif
        *mw = (v16){};
        return load_kpair_q6(b, i);
    }
    const float d = fp16_to_f32(b), dmin = fp16_to_f32(b + 2);
    int sc0, m0, sc1, m1;
    scale_min_k4(2 * i, b + 4, &sc0, &m0);
    scale_min_k4(2 * i + 1, b + 4, &sc1, &m1);
    *dw = select16(hi, d * (float)sc0, d * (float)sc1);
    *mw = select16(hi, -dmin * (float)m0, -dmin * (float)m1);
    return load_kpair_q4(b, i);
}

#endif /* KV_QUANT_DOT8_K_H */
