/*
 * Optional native (C, OpenMP) prefill attention reading K/V in place from the paged cache.
 *
 * The torch path attends each multi-token chunk with its own scaled_dot_product_attention
 * call per layer (torch's CPU flash kernel), after gathering the chunk's cached context into a
 * padded copy and building a bool mask when the chunk has earlier context (chunked prefill,
 * prefix caching) or a sliding window. This kernel attends every chunk of a step in one call
 * per layer, straight from the cache blocks, all query heads of a KV head sharing each K/V read
 * (GQA).
 *
 * Algorithm: flash attention (Dao et al., "FlashAttention: Fast and Memory-Efficient Exact
 * Attention with IO-Awareness", NeurIPS 2022): keys are visited in steps of 16 with a running
 * per-row maximum m, normaliser l and unnormalised output O; for every step with
 * scores s_j = scale * q.k_j::
 *
 *     m' = max(m, max_j s_j);  a = exp(m - m');  p_j = exp(s_j - m')
 *     l  = a * l + sum_j p_j;  O = a * O + sum_j p_j v_j;  m = m'
 *
 * and the output is O / l. Scores, softmax and sums are float32.
 *
 * Work items are (chunk, KV head, tile of 16 query rows), grouped by (chunk, KV head) -- the
 * groups longest first, a group's tiles from the last -- and shared out dynamically over the
 * OpenMP threads (consecutive items of a thread mostly read one group's K/V, still in its L2;
 * the cheapest come last). Inside an item the 16 rows of one query head are the 16 lanes of a
 * vector: the item's queries are transposed once ([D][16 rows]), so 16 keys give 16 score
 * vectors (no horizontal sums) and the softmax is lane-wise (per row: vertical maxima and sums
 * over the 16 keys). All G query heads of the KV head use each key step's K/V, read once.
 * Key steps are aligned to the tile's first position, so a tile has exactly one diagonal step;
 * steps past the tile's last row are never visited, and masks are only evaluated on the
 * diagonal step, on steps crossing a window edge and on steps reaching below the first key.
 *
 * Two inner kernels:
 *
 * * AVX-512 (float32; bfloat16 without AMX or with head_dim not a multiple of 32): scores by
 *   broadcast-FMAs k_j[d] x q^T[d] into 16 register accumulators; O row-major, P.V by
 *   register tiles of rows x head_dim (p broadcast, each v_j vector loaded once per
 *   tile). bfloat16 q is widened once per item, K and V once per step; vdpbf16ps for the
 *   scores (as in the decode kernel) is slower here, where the work is compute-bound.
 * * AMX (bfloat16, head_dim a multiple of 32, CPU and process with AMX tiles; USE_AMX):
 *   both products on tiles, transposed so rows stay lanes: S^T = K . Q^T and
 *   O^T += V^T . P^T, in key steps of 32 (a full tile depth for P^T). P is rounded to bfloat16 for the second product, as torch's CPU
 *   flash attention does for bfloat16 (its error is on par with torch's bfloat16 SDPA);
 *   O^T is kept in float32. Rescaling is lazy (as in FlashAttention-4's conditional
 *   rescaling): a row's reference maximum moves only when a step's scores exceed it by more
 *   than PF_LAZY (e^8: p <= ~3e3, exact in float32), so most steps add V^T . P^T
 *   to O^T on the tiles, and only the others rescale it with AVX-512. Each chunk's keys are
 *   gathered once per call and KV head (K rows and V^T, pf_gather; at most GATHER_BYTES
 *   at a time) instead of copied and transposed by every tile that reads them. Both pay most
 *   on long chunks and on chunks after cached context; short fresh chunks see no change.
 *
 * Quantized caches (kv_paged_prefill_attention_q8_*: int8 / float8 codes and a float16 scale
 * per row, kv_q8.h) take the AVX-512 path: each key step's rows are widened to code * scale in
 * float32 (exact: an 8-bit code times an 11-bit scale) where the unquantized path widens its
 * bfloat16 rows; the rest is the same. The chunk's own K/V are read back from the cache as
 * stored, as a later chunk or a prefix hit reads them (docs/kv_cache.md, Chunking).
 *
 * Outputs are rounded to nearest even on the bfloat16 store. Its speed against the torch path
 * is in docs/benchmarks.md (CPU kernels, benchmarks/attention_prefill_micro.py).
 *
 * Kernel contract (q rows may be any stride apart; everything else contiguous; q, cache and
 * out of one dtype, float32 or bfloat16; indices int64)::
 *
 *     q        [T, H, D]          query rows of all chunks, H = KH * G (heads h*G .. h*G+G-1
 *                                 share KV head h)
 *     cache    [2, KH, NB, BS, D] one layer's cache ([0] = K, [1] = V), the chunks' own K/V
 *                                 already written
 *     table    [C, NBMAX]         row c: block ids of block indices kstart[c]//BS, +1, ...
 *     q_start  [C + 1]            chunk c = rows q_start[c] .. q_start[c+1]-1 (non-decreasing)
 *     pos0     [C]                position of chunk c's first row (its cached context length)
 *     kstart   [C]                first key position the table covers (a multiple of BS, at
 *                                 most max(0, pos0[c] - window + 1), 0 without a window)
 *     window   int                0: causal; W > 0: a row at position p attends keys p-W+1 .. p
 *     out      [T, H, D]          rows of the chunks written, others untouched
 *
 * A row at position p attends keys max(0, p - W + 1) <= k <= p (all k <= p for
 * W = 0), as the torch path's masks. The kernel checks the chunk geometry (row ranges, key
 * starts, table width, block ids in range) before touching memory; the wrapper raises
 * ValueError for a violation.
 */
#include "kv_q8.h"
#include "kv_vec.h"
#include "transpose16.h"

#include <immintrin.h>
#define PMAXC 16 /* head_dim / 16 <= 16 */

static inline v16 vsel(v16i m, v16 a, v16 b) { return (v16)(((v16i)a & m) | ((v16i)b & ~m)); }

/* Arguments shared by every work item (pointers untyped: one struct for both dtypes). */
typedef struct {
    const void* q;
    int64_t qs;
    const void* cache;
    const int64_t* table;
    int64_t nbmax;
    const int64_t* q_start;
    const int64_t* pos0;
    const int64_t* kstart;
    int64_t window;
    void* out;
    int64_t KH, G, D, NB, BS;
    float scale;
    /* AMX path: each chunk's keys gathered once per call (pf_gather): K rows and V^T, per KV
       head, keys gbase[c] .. gbase[c] + glen[c] - 1, at element offset goff[c] (+ h * glen * D) */
    const uint16_t* kg;
    const uint16_t* vtg;
    const int64_t* gbase;
    const int64_t* glen;
    const int64_t* goff;
    /* -1: the cache holds ELEM rows; else a quantized cache (kv_q8.h: rows of D codes of this
       kind and a float16 scale, D + 2 bytes), widened to float32 as each key step is read */
    int qkind;
} pf_args;

/* One work item: 16-row tile t of chunk c for KV head h; gcost = key steps of all tiles of
   (c, h) (for ordering). */
typedef struct {
    int32_t c, h, t;
    int64_t gcost;
} pf_item;

/* Order: (chunk, KV head) groups by total cost, longest first, and within a group its tiles
   from the last (longest) to the first. Consecutive items of a thread then mostly share one
   group's K/V (in its L2), and the cheapest items come last, so the threads finish together. */
static int pf_item_cmp(const void* x, const void* y) {
    const pf_item* a = (const pf_item*)x;
    const pf_item* b = (const pf_item*)y;
    if (a->gcost != b->gcost) return a->gcost > b->gcost ? -1 : 1;
    if (a->c != b->c) return a->c - b->c;
    if (a->h != b->h) return a->h - b->h;
    return b->t - a->t;
}

/* Where a work item sits: its rows, their positions and its key steps. */
typedef struct {
    int64_t r0;        /* batch row of lane 0 */
    int64_t nr;        /* real rows in the tile (lanes nr..15 are padding) */
    int64_t pf, pl;    /* positions of lane 0 and of the last real row */
    int64_t kmin;      /* first key any row attends (the window start of lane 0, or 0) */
    int64_t nsteps;    /* key steps of 16; step s starts at pf - 16 * (nsteps - 1 - s) */
    int64_t fb;        /* block index of the table's first entry */
    const int64_t* tb; /* the chunk's table row */
    int64_t hoff;      /* element offset of KV head h in one half (K or V) of the cache */
} pf_geom;

static inline pf_geom pf_geom_of(const pf_args* A, pf_item it) {
    pf_geom g;
    const int64_t n = A->q_start[it.c + 1] - A->q_start[it.c], W = A->window;
    g.r0 = A->q_start[it.c] + 16 * it.t;
    g.nr = n - 16 * it.t < 16 ? n - 16 * it.t : 16;
    g.pf = A->pos0[it.c] + 16 * it.t;
    g.pl = g.pf + g.nr - 1;
    const int64_t klo = W > 0 ? (g.pf - W + 1 > 0 ? g.pf - W + 1 : 0) : 0;
    g.kmin = klo > A->kstart[it.c] ? klo : A->kstart[it.c]; /* == klo under the contract */
    g.nsteps = (g.pf - klo + 15) / 16 + 1;                  /* the last one is the diagonal */
    g.fb = A->kstart[it.c] / A->BS;
    g.tb = A->table + it.c * A->nbmax;
    g.hoff = it.h * A->NB * A->BS * A->D;
    return g;
}

/* Lane masks of the step at k0 (mk[j]: rows allowed to attend key k0 + j); returns 0 (masks
   not written) when every (row, key) pair of the step is allowed. Masks are needed on the
   diagonal step, a step reaching below the first key, a step crossing some row's window start. */
static inline int pf_masks(const pf_geom* g, int64_t k0, int64_t W, v16i* mk) {
    if (!(k0 + 15 > g->pf || k0 < g->kmin || (W > 0 && k0 <= g->pf + 15 - W))) return 0;
    v16i rowpos;
    for (int i = 0; i < 16; ++i) rowpos[i] = (int32_t)(g->pf + i);
    for (int64_t j = 0; j < 16; ++j) {
        const int32_t kk = (int32_t)(k0 + j);
        v16i ok = (rowpos >= kk) & ((v16i){} + (kk >= g->kmin ? -1 : 0));
        if (W > 0) ok &= rowpos - (int32_t)W < kk;
        mk[j] = ok;
    }
    return 1;
}

/* One online-softmax step for 16 rows (lanes): x[j] = the rows' q.k_j for the step's 16 keys.
   Leaves p_j = exp(scale * x[j] - m_new) in x[j] (0 where masked), updates *m and *l, returns
   alpha = exp(m_old - m_new) for the previous O. A lane with every key so far masked keeps
   m = -inf; it subtracts 0 instead (no inf - inf). */
static inline __attribute__((always_inline)) v16 pf_softmax(v16* x, float scale, int need, const v16i* mk,
                                                            v16* m, v16* l) {
    v16 mx = (v16){} - INFINITY;
    for (int j = 0; j < 16; ++j) {
        x[j] *= scale;
        if (need) x[j] = vsel(mk[j], x[j], (v16){} - INFINITY);
        mx = vmax(mx, x[j]);
    }
    const v16 m_old = *m, m_new = vmax(m_old, mx);
    const v16 m_use = vsel(m_new == -INFINITY, (v16){}, m_new);
    const v16 alpha = exp16(m_old - m_use);
    v16 psum = (v16){};
    for (int j = 0; j < 16; ++j) {
        v16 e = exp16(x[j] - m_use);
        if (need) e = vsel(mk[j], e, (v16){});
        psum += e;
        x[j] = e;
    }
    *l = *l * alpha + psum;
    *m = m_new;
    return alpha;
}

/* Per-thread scratch (64-byte aligned; all row lengths are multiples of 16 floats). The AMX
   path keeps bfloat16 data in the same buffers (see pf_item_amx). */
typedef struct {
    v16* qt;      /* [G][D]: transposed queries, lane = row */
    float* o;     /* [G][16][D]: unnormalised outputs, row-major (AMX: [G][D][16]) */
    v16* m;       /* [G] running row maxima */
    v16* l;       /* [G] running normalisers */
    float* kf;    /* [16][D] the step's keys, float */
    float* vf;    /* [16][D] the step's values, float */
    float* p;     /* [16 keys][16 rows] probabilities of the step (AMX: [32][16] scores) */
    float* alpha; /* [16] rescale factor of the step */
    v16i* mk;     /* [16] per key: lanes (rows) allowed to attend it (AMX: [32]) */
    float* tmp;   /* [32][16] AMX: two O^T tiles of the step */
    uint32_t* pt; /* [16][16] AMX: the step's P^T as key pairs */
} pf_scratch;

/* The scratch of the calling thread: kept between calls (grown when needed, never freed), so
   a step's 30 layer calls do not allocate -- and, in a worker thread, do not page-fault a
   freshly allocated buffer each time (glibc returns a thread arena's freed top to the OS). */
static __thread char* pf_tls_buf = NULL;
static __thread size_t pf_tls_size = 0;

/* The calling thread's buffer of gathered keys (AMX path), grown when needed, never freed; a
   call's chunks go in batches of at most gather_bytes of it (a chunk alone may need more). */
static __thread uint16_t* pf_gather_buf = NULL;
static __thread size_t pf_gather_size = 0;

static void* pf_scratch_alloc(pf_scratch* s, int64_t G, int64_t D) {
    const size_t f = sizeof(float);
    size_t sz[11] = {G * D * 16 * f, G * 16 * D * f, G * 64, G * 64, 16 * D * f, 16 * D * f, 512 * f, 64,
                     32 * 64,        512 * f,        256 * 4};
    size_t total = 0;
    for (int i = 0; i < 11; ++i) total += (sz[i] + 63) & ~(size_t)63;
    if (pf_tls_size < total) {
        free(pf_tls_buf);
        pf_tls_buf = (char*)aligned_alloc(64, total);
        pf_tls_size = pf_tls_buf ? total : 0;
    }
    char* base = pf_tls_buf;
    if (!base) return NULL;
    char* p = base;
    void** dst[11] = {(void**)&s->qt, (void**)&s->o,   (void**)&s->m, (void**)&s->l,
                      (void**)&s->kf, (void**)&s->vf,  (void**)&s->p, (void**)&s->alpha,
                      (void**)&s->mk, (void**)&s->tmp, (void**)&s->pt};
    for (int i = 0; i < 11; ++i) {
        *dst[i] = p;
        p += (sz[i] + 63) & ~(size_t)63;
    }
    return base;
}

/* Geometry check (before any memory is touched): 0 if fine, else an error code with the chunk
   in *bad: 1 q_start, 2 pos0, 3 kstart, 4 table too narrow, 5 block id out of range. */
static int pf_check(const int64_t* q_start, const int64_t* pos0, const int64_t* kstart, const int64_t* table,
                    int64_t nbmax, int64_t nc, int64_t T, int64_t W, int64_t NB, int64_t BS, int64_t* bad) {
    for (int64_t c = 0; c < nc; ++c) {
        *bad = c;
        const int64_t a = q_start[c], b = q_start[c + 1];
        if (a < 0 || b < a || b > T) return 1;
        /* positions of the chunk's tiles (padding lanes included) must fit the int32 lanes of
           pf_masks */
        if (pos0[c] < 0 || pos0[c] > INT32_MAX - 16 - (b - a)) return 2;
        const int64_t n = b - a;
        if (n == 0) continue;
        const int64_t klo = W > 0 ? (pos0[c] - W + 1 > 0 ? pos0[c] - W + 1 : 0) : 0;
        if (kstart[c] < 0 || kstart[c] % BS || kstart[c] > klo) return 3;
        const int64_t nblk = (pos0[c] + n - 1) / BS - kstart[c] / BS + 1;
        if (nblk > nbmax) return 4;
        for (int64_t i = 0; i < nblk; ++i)
            if (table[c * nbmax + i] < 0 || table[c * nbmax + i] >= NB) return 5;
    }
    *bad = -1;
    return 0;
}

/* Keys the 32-key steps of chunk c's tiles touch: [*base, *base + *len), len a multiple of 32
   (the tiles' steps start at pf - 16 - 32 * (nsteps32 - 1) and end at pf + 15). */
static void pf_key_range(const pf_args* A, int64_t c, int64_t* base, int64_t* len) {
    const int64_t n = A->q_start[c + 1] - A->q_start[c], W = A->window;
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t t = 0; t < (n + 15) / 16; ++t) {
        const int64_t pf = A->pos0[c] + 16 * t;
        const int64_t klo = W > 0 ? (pf - W + 1 > 0 ? pf - W + 1 : 0) : 0;
        const int64_t n32 = ((pf - klo + 15) / 16 + 2) / 2;
        const int64_t k0 = pf - 16 - 32 * (n32 - 1);
        if (k0 < lo) lo = k0;
        hi = pf + 16;
    }
    *base = lo;
    *len = n > 0 ? (hi - lo + 31) / 32 * 32 : 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PF_AMX 1

#include "amx_tiles.h"

/* Headroom of the lazy rescaling (natural-log units): probabilities up to e^8 ~ 3e3. */
#define PF_LAZY 8.0f

/* Tiles (config_tiles: all 16 rows x 64 bytes): 0, 1 S^T [16 keys][16 rows] f32 (keys 0-15,
   16-31 of the step); 2 K [16 keys][32 d] bf16, later V^T; 3 Q^T [16 d pairs][16 rows x 2]
   bf16; 4 P^T [16 key pairs][16 rows x 2] bf16; 5 K (keys 16-31), later V^T [16 d][32 keys]
   bf16; 6, 7 O^T [16 d][16 rows] f32. */

/* Gather KV head h of chunk c once for all its tiles: K rows [len][D] (A tiles of S^T = K . Q^T)
   and V^T [D][len] (A tiles of O^T += V^T . P^T), keys base .. base + len - 1; keys outside
   the table (below kstart) or not written yet (from pos0 + n) are zero. Before, every tile
   copied and transposed its steps' keys itself: with 512 cached tokens per chunk that was a
   third of the kernel's time. */
static void pf_gather(const pf_args* A, int64_t c, int64_t h, uint16_t* kg, uint16_t* vtg, int64_t base,
                      int64_t len) {
    const int64_t D = A->D, BS = A->BS, KC = D / 32;
    const uint16_t* kbase = (const uint16_t*)A->cache + h * A->NB * BS * D;
    const uint16_t* vbase = kbase + A->KH * A->NB * BS * D;
    const int64_t* tb = A->table + c * A->nbmax;
    const int64_t fb = A->kstart[c] / BS, kbeg = A->kstart[c];
    const int64_t kend = A->pos0[c] + A->q_start[c + 1] - A->q_start[c];
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const uint16_t* vr[16];
        for (int64_t j = 0; j < 16; ++j) {
            const int64_t k = base + j0 + j;
            if (k < kbeg || k >= kend) {
                memset(kg + (j0 + j) * D, 0, D * 2);
                vr[j] = NULL;
                continue;
            }
            const int64_t row = (tb[k / BS - fb] * BS + k % BS) * D;
            memcpy(kg + (j0 + j) * D, kbase + row, D * 2);
            vr[j] = vbase + row;
        }
        /* 16 x 16 blocks of 32-bit d pairs transposed: the low and high halves of transposed
           pair row w are the V^T rows 2w and 2w + 1. */
        for (int64_t kc = 0; kc < KC; ++kc) {
            v16 x[16];
            for (int64_t j = 0; j < 16; ++j) x[j] = vr[j] ? *(const v16*)(vr[j] + 32 * kc) : (v16){};
            transpose16(x);
            for (int64_t w = 0; w < 16; ++w) {
                const __m512i xw = (__m512i)x[w];
                _mm256_storeu_si256((__m256i*)(vtg + (32 * kc + 2 * w) * len + j0),
                                    _mm512_cvtepi32_epi16(xw));
                _mm256_storeu_si256((__m256i*)(vtg + (32 * kc + 2 * w + 1) * len + j0),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(xw, 16)));
            }
        }
    }
}

/* One work item, bfloat16, head_dim a multiple of 32, on AMX tiles. Both products are
   computed transposed, so that a query row stays a lane as in the AVX-512 path:
     S^T [keys][rows] = K [keys][D] . Q^T      (B = Q^T as d pairs: the item's q rows, viewed as
                                                32-bit pairs, transposed once per item)
     O^T [D][rows]   += V^T [D][keys] . P^T    (A = V^T, built per step for all G heads; B = P^T
                                                as key pairs, from the softmax's lane vectors)
   Key steps are 32 keys (a full tile depth for P.V), the last one ending with the diagonal 16;
   a first step reaching below the first key has those keys zero and masked. P is rounded to
   bfloat16 (nearest even) for the second product, as torch's CPU flash attention does for
   bfloat16; l sums the float32 values. O^T lives in float32 memory: a step that moves no
   row's reference maximum (lazy rescaling, PF_LAZY) accumulates it on the tiles; the others
   rescale it by alpha with AVX-512 and add the step's product. */
static void pf_item_amx(const pf_args* A, pf_item it, pf_scratch* S) {
    const int64_t D = A->D, KC = D / 32, ND = D / 16, G = A->G, W = A->window;
    const uint16_t* q = (const uint16_t*)A->q;
    uint16_t* out = (uint16_t*)A->out;
    const pf_geom geo = pf_geom_of(A, it);
    const int64_t H = A->KH * G, nr = geo.nr;
    const int64_t nsteps = (geo.nsteps + 1) / 2; /* 32-key steps covering the 16-key ones */
    const int64_t L = A->glen[it.c], gb = A->gbase[it.c];
    const uint16_t* kgh = A->kg + A->goff[it.c] + it.h * L * D;  /* [L keys][D] */
    const uint16_t* vgh = A->vtg + A->goff[it.c] + it.h * L * D; /* [D][L keys] */
    uint32_t* qtw = (uint32_t*)S->qt;                            /* [G][KC][16 d pairs][16 rows] */
    float* ot = S->o;                                            /* [G][D][16 rows] */
    float* sc = S->p; /* [32 keys][16 rows] scores, then probabilities */

    for (int64_t g = 0; g < G; ++g) {
        const uint16_t* qg = q + geo.r0 * A->qs + (it.h * G + g) * D;
        for (int64_t kc = 0; kc < KC; ++kc) {
            v16 x[16];
            for (int64_t i = 0; i < 16; ++i)
                x[i] = i < nr ? *(const v16*)(qg + i * A->qs + 32 * kc) : (v16){};
            transpose16(x);
            for (int64_t w = 0; w < 16; ++w) *(v16*)(qtw + ((g * KC + kc) * 16 + w) * 16) = x[w];
        }
        for (int64_t i = 0; i < 16 * D; i += 16) *(v16*)(ot + g * 16 * D + i) = (v16){};
        S->m[g] = (v16){} - INFINITY;
        S->l[g] = (v16){};
    }
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                         22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t s = 0; s < nsteps; ++s) {
        const int64_t k0 = geo.pf - 16 - 32 * (nsteps - 1 - s);
        const int64_t ka = k0 > geo.kmin ? k0 : geo.kmin;
        const int lo = ka < k0 + 16;              /* keys 0-15 of the step exist for some row */
        const uint16_t* kb = kgh + (k0 - gb) * D; /* A tiles: 16 keys x 32 d, stride D */
        const uint16_t* vt = vgh + (k0 - gb);     /* A tiles: 16 d x 32 keys, stride L */
        /* Lane masks of the step's two 16-key halves (a half without masks gets all-ones). */
        const int need0 = pf_masks(&geo, k0, W, S->mk);
        const int need1 = pf_masks(&geo, k0 + 16, W, S->mk + 16);
        if (need0 != need1)
            for (int j = need0 ? 16 : 0, e = j + 16; j < e; ++j) S->mk[j] = (v16i){} - 1;
        const int need = need0 | need1;

        for (int64_t g = 0; g < G; ++g) {
            if (lo) _tile_zero(0);
            _tile_zero(1);
            for (int64_t kc = 0; kc < KC; ++kc) {
                _tile_loadd(3, qtw + (g * KC + kc) * 256, 64);
                if (lo) {
                    _tile_loadd(2, kb + 32 * kc, D * 2);
                    _tile_dpbf16ps(0, 2, 3);
                }
                _tile_loadd(5, kb + 16 * D + 32 * kc, D * 2);
                _tile_dpbf16ps(1, 5, 3);
            }
            if (lo) _tile_stored(0, sc, 64);
            else
                for (int j = 0; j < 16; ++j) *(v16*)(sc + 16 * j) = (v16){} - INFINITY; /* all masked */
            _tile_stored(1, sc + 256, 64);
            /* Online softmax over the 32 keys, lane-wise (as pf_softmax), from memory. */
            v16 mx = (v16){} - INFINITY;
            for (int j = 0; j < 32; ++j) {
                v16 x = *(const v16*)(sc + 16 * j) * A->scale;
                if (need) x = vsel(S->mk[j], x, (v16){} - INFINITY);
                *(v16*)(sc + 16 * j) = x;
                mx = vmax(mx, x);
            }
            /* Lazy rescaling: the reference maximum of a row moves only when the step's maximum
               exceeds it by more than PF_LAZY (p stays <= e^PF_LAZY, harmless in float32), so
               most steps leave O^T as it is and accumulate it on the tiles (no alpha pass). */
            const v16 m_old = S->m[g];
            const v16i grow = mx > m_old + PF_LAZY;
            const v16 m_new = vsel(grow, mx, m_old);
            const v16 m_use = vsel(m_new == -INFINITY, (v16){}, m_new);
            /* O^T and l are still zero in lanes whose keys were all masked so far (m_old -inf) */
            const int rescale = _mm512_test_epi32_mask((__m512i)(grow & (m_old > -INFINITY)),
                                                       (__m512i)(grow & (m_old > -INFINITY))) != 0;
            const v16 alpha = rescale ? exp16(m_old - m_use) : (v16){} + 1.0f;
            v16 psum = (v16){};
            /* P^T pairs: word [pair][row] = (p[2 pair][row], p[2 pair + 1][row]) as bf16: both
               rows rounded by one vcvtne2ps2bf16 ([p[2 pair] | p[2 pair + 1]]), interleaved. */
            for (int pp = 0; pp < 16; ++pp) {
                v16 e0 = exp16(*(const v16*)(sc + 32 * pp) - m_use);
                v16 e1 = exp16(*(const v16*)(sc + 32 * pp + 16) - m_use);
                if (need) {
                    e0 = vsel(S->mk[2 * pp], e0, (v16){});
                    e1 = vsel(S->mk[2 * pp + 1], e1, (v16){});
                }
                psum += e0 + e1;
                const __m512i two = (__m512i)_mm512_cvtne2ps_pbh((__m512)e1, (__m512)e0);
                _mm512_store_si512((void*)(S->pt + 16 * pp), _mm512_permutexvar_epi16(ilv, two));
            }
            S->l[g] = S->l[g] * alpha + psum;
            S->m[g] = m_new;
            _tile_loadd(4, S->pt, 64);
            float* og = ot + g * D * 16;
            for (int64_t db = 0; db < ND; db += 2) {
                _tile_loadd(5, vt + db * 16 * L, L * 2);
                _tile_loadd(2, vt + (db + 1) * 16 * L, L * 2);
                if (!rescale) { /* O^T += V^T . P^T on the tiles */
                    _tile_loadd(6, og + db * 256, 64);
                    _tile_loadd(7, og + db * 256 + 256, 64);
                    _tile_dpbf16ps(6, 5, 4);
                    _tile_dpbf16ps(7, 2, 4);
                    _tile_stored(6, og + db * 256, 64);
                    _tile_stored(7, og + db * 256 + 256, 64);
                    continue;
                }
                _tile_zero(6);
                _tile_zero(7);
                _tile_dpbf16ps(6, 5, 4);
                _tile_dpbf16ps(7, 2, 4);
                _tile_stored(6, S->tmp, 64);
                _tile_stored(7, S->tmp + 256, 64);
                for (int64_t i = 0; i < 32; ++i) {
                    v16* o = (v16*)(og + (db * 16 + i) * 16);
                    *o = *o * alpha + *(const v16*)(S->tmp + 16 * i);
                }
            }
        }
    }

    /* Outputs: O^T rows d, d + 1 rounded to bfloat16 together and interleaved into 32-bit
       pairs (as P^T above), then one 16 x 16 transpose per 32 d gives each row's 64 bytes. */
    for (int64_t g = 0; g < G; ++g) {
        const v16 inv = 1.0f / S->l[g];
        for (int64_t kc = 0; kc < KC; ++kc) {
            v16 x[16];
            for (int64_t w = 0; w < 16; ++w) {
                const float* od = ot + (g * D + 32 * kc + 2 * w) * 16;
                const __m512i two = (__m512i)_mm512_cvtne2ps_pbh((__m512)(*(const v16*)(od + 16) * inv),
                                                                 (__m512)(*(const v16*)od * inv));
                x[w] = (v16)_mm512_permutexvar_epi16(ilv, two);
            }
            transpose16(x);
            for (int64_t r = 0; r < nr; ++r)
                *(v16*)(out + (geo.r0 + r) * H * D + (it.h * G + g) * D + 32 * kc) = x[r];
        }
    }
}
#endif

#define KV_DTYPE_TEMPLATE "prefill_attention_dtype.h"
#include "kv_instantiate.h"
