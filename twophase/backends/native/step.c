/* One forward step of a Llama model on block-quantised weights, for the CPU: every op of every
 * layer inside one OpenMP parallel region, so an op costs a barrier, not a dispatch.
 *
 * Weights are GGUF's blocks, their bytes regrouped once when packed (twophase/backends/native/
 * weights.py) into the order the kernels stream: Q4_1 projections (fp16 d and m, 4-bit codes q,
 * w = d*q + m) and a Q8_0 head. Activations are rounded to int8 per block of 32 before they meet
 * the codes (as llama.cpp's Q8_1 and ONNX Runtime's accuracy level 4 do), with the two exact
 * rewrites of the ONNX path (twophase/exporters/q4.py):
 *  - centred zero points: w = d*(q - z) + (m + z*d) with z near -m/d, so the int8 rounding error
 *    meets weights near their true values; the integer dot is the same, and the correction is
 *    z*d times the block's rounding error, e = sum(x) - dx*sum(xq), known per activation block;
 *  - outlier channels: a few input channels are zeroed before the rounding and multiplied in
 *    float32 by their own weights.
 *
 * The kernels work on groups of 8 blocks, one block per 32-bit lane: the codes are laid out so
 * that lane j of the group's k-th vector holds elements 4k..4k+3 of block j, for weights and
 * activations alike. Eight int8 dots (VNNI vpdpbusd) then leave each block's exact integer dot
 * in its own lane, with no horizontal sum; the group's eight scales are one fp16 vector, and the
 * float work (the scale products, the minimum's and zero point's terms) is a few vector ops a
 * group. A row's last nb % 8 blocks are a short group, its lanes masked.
 *
 * Rows of a step are tokens: decodes (one per sequence) or the tokens of prefill chunks. Every
 * row writes its K/V into the pool at its slot before any row attends, so a chunk's tokens see
 * each other, causally, through the pool. Pool layout: [L, 2, NB, KVH, BS, hd] float32.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define QK 32
#define OUT_MAX 64
#define GB 8                    /* blocks in a group, one 32-bit lane each */
#define INLINE static inline __attribute__((always_inline))

/* acc + the integer dots of unsigned codes with signed ones, four bytes a lane: one VNNI
   instruction where the CPU has it, else AVX2's (no saturation for 4-bit codes: a pair of
   products is at most 2 * 15 * 127) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, q, v) _mm256_dpbusd_epi32((acc), (q), (v))
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, q, v) _mm256_dpbusd_avx_epi32((acc), (q), (v))
#else
#define DPBUSD(acc, q, v) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((q), (v)), _mm256_set1_epi16(1)))
#endif

/* The head's 8-bit codes are stored offset by 128 (u = q + 128, unsigned): with VNNI the dot
   of u with the activations less 128 times their sum is the signed dot. AVX2's maddubs would
   saturate on 255 * 127 pairs, so without VNNI the codes go back to signed and take the sign
   trick (|q| against v with q's sign; at most 2 * 128 * 127). The integers are the same. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
#define HDOT(acc, u, v) DPBUSD(acc, u, v)
#define HFIX(acc, sum) _mm256_sub_epi32((acc), _mm256_slli_epi32((sum), 7))
#else
static inline __m256i hdot_avx2(__m256i acc, __m256i u, __m256i v) {
    const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(v, q)),
                                                   _mm256_set1_epi16(1)));
}
#define HDOT(acc, u, v) hdot_avx2((acc), (u), (v))
#define HFIX(acc, sum) (acc)
#endif

/* A projection's rows, each nb = k/32 blocks as 21*nb bytes:
     d[nb] fp16 | m[nb] fp16 | z[nb] zero points | codes, 16*nb bytes
   The codes go by groups of 8 blocks, 128 bytes: four 32-byte vectors P0..P3, lane j of Pk the
   bytes 4k..4k+3 of block j's GGUF qs (low nibbles elements 4k.., high ones 16+4k..). The last
   t = nb % 8 blocks are the same four vectors cut to t lanes (4*t bytes each). A group's loads
   of d, m and z read 8 lanes from the group's first block: past a short group they read the next
   field of the row (masked out), never past the row. */
typedef struct {
    int n, k, n_out;
    const uint8_t *w;       /* [n][21 * k/32] */
    const int32_t *out_idx; /* [n_out] outlier input channels */
    const float *out_w;     /* [n][n_out] their weights */
} proj_q4;

/* The head's rows, 34*nb bytes: d[nb] fp16 | codes + 128, 32*nb bytes, by groups of 8 blocks as
   eight 32-byte vectors (lane j of the k-th: block j's bytes 4k..4k+3), the last t blocks cut
   to t lanes. */
typedef struct { int n, k; const uint8_t *w; } proj_q8;
typedef struct {
    int layers, dim, heads, kv_heads, head_dim, ffn, vocab;
    float eps;
    const float *embed;       /* [vocab][dim] */
    const float *attn_norm;   /* [layers][dim] */
    const float *mlp_norm;    /* [layers][dim] */
    const float *final_norm;  /* [dim] */
    const float *inv_freq;    /* [head_dim / 2] */
    const proj_q4 *qkv, *o, *gate_up, *down;   /* [layers] each */
    proj_q8 head;
} model_t;

typedef struct {
    int rows;                 /* tokens in the step */
    const int64_t *tokens, *positions, *slots;   /* [rows] */
    const int64_t *tables;    /* [seqs][width] block ids */
    int width;
    const int32_t *seq;       /* [rows] the row's sequence (its table) */
    const int32_t *ctx;       /* [rows] tokens it attends to, itself included */
    int n_logits;
    const int32_t *logit_rows;/* [n_logits] */
    float *pool; int num_blocks, block_size;
    float *logits;            /* [n_logits][vocab] */
    float *scratch;           /* step_scratch_floats() floats */
    int max_ctx;
    int threads;              /* named here: the OpenMP runtime may be torch's, set to 1 for glue */
} step_t;


/* a row's activations, rounded: int8 codes in the groups' lane order (a short group padded with
   zeros to 8 lanes), and per block (padded to a multiple of 8, zeros) the step, the float sum,
   the rounding error of the sum and the sum of the codes; the outlier channels' float values */
typedef struct { int8_t *q; float *d, *s, *e; int32_t *u; float *xo; } qact;

static inline int groups_of(int k) { return (k / QK + GB - 1) / GB; }

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

static inline float hsum8(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* e^x, Cephes's single-precision method (range reduction by ln 2, degree-5 polynomial): within
   2 ulp of expf over [-87, 88], eight at a time */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* y = silu(g) * u (SwiGLU) over n elements */
static void swiglu(const float *g, const float *u, float *y, int n) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)));
        _mm256_storeu_ps(y + i, _mm256_div_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(u + i)), den));
    }
    for (; i < n; i++) y[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

static inline float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float p, const float *x, int n) {
    const __m256 pv = _mm256_set1_ps(p);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += p * x[i];
}

static qact row_of(qact a, int r, int k) {
    const size_t nbp = (size_t)groups_of(k) * GB;
    qact out = { a.q + (size_t)r * nbp * QK, a.d + (size_t)r * nbp, a.s + (size_t)r * nbp,
                 a.e + (size_t)r * nbp, a.u + (size_t)r * nbp, a.xo + (size_t)r * OUT_MAX };
    return out;
}

/* int8 codes of one block of 32: v * id rounded to nearest even (as lrintf), in order */
static inline void codes_32(const float *v, float id, int8_t *q, __m256i *qsum) {
    const __m256 s = _mm256_set1_ps(id);
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), s));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), s));
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16), s));
    const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 24), s));
    *qsum = _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d));
    /* packs interleave 128-bit lanes: the permute puts the 32 codes back in order */
    const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    const __m256i all = _mm256_packs_epi16(ab, cd);
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(all, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

static inline int hsum8i(__m256i v) {
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(1, 0, 3, 2)));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(r);
}

static void quantize_row(const float *x, int k, const int32_t *idx, int n_out, qact a) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const int nb = k / QK, nbp = groups_of(k) * GB;
    for (int i = 0; i < n_out; i++) a.xo[i] = x[idx[i]];
    for (int b = nb; b < nbp; b++) { a.d[b] = a.s[b] = a.e[b] = 0.f; a.u[b] = 0; }
    for (int b = 0; b < nb; b++) {
        float v[QK];
        memcpy(v, x + b * QK, sizeof v);
        for (int i = 0; i < n_out; i++)
            if (idx[i] / QK == b) v[idx[i] % QK] = 0.f;
        __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int j = 0; j < QK; j += 8) {
            const __m256 u = _mm256_loadu_ps(v + j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, u));
            sum = _mm256_add_ps(sum, u);
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float d = _mm_cvtss_f32(m) / 127.f, id = d > 0.f ? 1.f / d : 0.f, fsum = hsum8(sum);
        __m256i qsum;
        int8_t *group = a.q + (size_t)(b / GB) * GB * QK;
        if (b >= nb / GB * GB) {
            codes_32(v, id, group + (b % GB) * QK, &qsum);      /* the short group: in order */
        } else {
            int8_t codes[QK];
            codes_32(v, id, codes, &qsum);
            for (int i = 0; i < 8; i++) memcpy(group + (b % GB) * 4 + 32 * i, codes + 4 * i, 4);   /* lane b % 8 */
        }
        const int isum = hsum8i(qsum);
        a.d[b] = d;
        a.s[b] = fsum;
        a.e[b] = fsum - d * (float)isum;
        a.u[b] = isum;
    }
}

/* the outlier channels' float term: whole vectors of 8 into the lanes of acc, the rest into *rest */
static inline __m256 outliers(const proj_q4 *p, int n, const qact *x, __m256 acc, float *rest) {
    const float *ow = p->out_w + (size_t)n * p->n_out;
    int j = 0;
    for (; j + 8 <= p->n_out; j += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(ow + j), _mm256_loadu_ps(x->xo + j), acc);
    float r = 0.f;
    for (; j < p->n_out; j++) r += ow[j] * x->xo[j];
    *rest = r;
    return acc;
}

/* the sums of four vectors' lanes, ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)) each */
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* dst[0..m) (+)= v's first m lanes */
INLINE void put_m(float *dst, __m128 v, const int m, int accumulate) {
    if (m == 4) {
        _mm_storeu_ps(dst, accumulate ? _mm_add_ps(_mm_loadu_ps(dst), v) : v);
    } else {
        float t[4];
        _mm_storeu_ps(t, v);
        for (int i = 0; i < m; i++) dst[i] = accumulate ? dst[i] + t[i] : t[i];
    }
}

typedef struct { const uint8_t *d, *m, *z, *c; } q4row;

INLINE q4row q4_row(const proj_q4 *p, int n) {
    const size_t nb = p->k / QK;
    const uint8_t *w = p->w + (size_t)n * 21 * nb;
    const q4row r = { w, w + 2 * nb, w + 4 * nb, w + 5 * nb };
    return r;
}

INLINE __m256i lanes_below(int t) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(t), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* group g of the weight rows w[0..M) against the activation rows x[0..N), into acc[i][j]'s lanes
   (lane l: block 8g + l). Per (i, j) the same operations whatever M and N, so a row's result
   does not depend on its tile: the eight blocks' exact integer dots, then acc += idot * (dw * dx),
   += m * s, += z*dw * e */
INLINE void group_q4(const q4row *w, const int M, const qact *x, const int N, const int g, __m256 acc[4][4]) {
    const __m256i lo = _mm256_set1_epi8(0x0F);
    __m256 dv[4], mv[4], zd[4];
    __m256i iacc[4][4];
    #pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        dv[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[i].d + 16 * g)));
        mv[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[i].m + 16 * g)));
        const __m128i z8 = _mm_loadl_epi64((const __m128i *)(w[i].z + 8 * g));
        zd[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(z8)), dv[i]);
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) iacc[i][j] = _mm256_setzero_si256();
    }
    #pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        __m256i ql[4], qh[4];
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const __m256i P = _mm256_loadu_si256((const __m256i *)(w[i].c + 128 * g + 32 * k));
            ql[i] = _mm256_and_si256(P, lo);
            qh[i] = _mm256_and_si256(_mm256_srli_epi16(P, 4), lo);
        }
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const int8_t *v = x[j].q + 256 * g;
            const __m256i vl = _mm256_loadu_si256((const __m256i *)(v + 32 * k));
            const __m256i vh = _mm256_loadu_si256((const __m256i *)(v + 32 * (k + 4)));
            #pragma GCC unroll 4
            for (int i = 0; i < M; i++) {
                iacc[i][j] = DPBUSD(iacc[i][j], ql[i], vl);
                iacc[i][j] = DPBUSD(iacc[i][j], qh[i], vh);
            }
        }
    }
    #pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        const __m256 dx = _mm256_loadu_ps(x[j].d + 8 * g), s = _mm256_loadu_ps(x[j].s + 8 * g);
        const __m256 e = _mm256_loadu_ps(x[j].e + 8 * g);
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[i][j]), _mm256_mul_ps(dv[i], dx), acc[i][j]);
            a = _mm256_fmadd_ps(mv[i], s, a);
            acc[i][j] = _mm256_fmadd_ps(zd[i], e, a);
        }
    }
}

/* the row's last t = nb % 8 blocks (G: their group), each in its GGUF order (16 code bytes,
   low nibbles elements 0-15, high 16-31; the activations' 32 codes in order): a block's integer
   dot is left as eight lanes of partial sums, scaled by its (dw * dx) and added into acc[i][j]'s
   lanes; then the minimum's and zero point's terms of the t blocks, their lanes masked */
INLINE void tail_q4(const q4row *w, const int M, const qact *x, const int N, const int G, const int t,
                    __m256 acc[4][4]) {
    const __m256i lo = _mm256_set1_epi8(0x0F);
    const __m256 keep = _mm256_castsi256_ps(lanes_below(t));
    __m256 mv[4], zd[4];
    float dw[4][GB];
    #pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        const __m256 dv = _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[i].d + 16 * G))), keep);
        _mm256_storeu_ps(dw[i], dv);
        mv[i] = _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[i].m + 16 * G))), keep);
        const __m128i z8 = _mm_loadl_epi64((const __m128i *)(w[i].z + 8 * G));
        zd[i] = _mm256_and_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(z8)), dv), keep);
    }
    for (int b = 0; b < t; b++) {
        __m256i q[4];
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const __m128i c = _mm_loadu_si128((const __m128i *)(w[i].c + 128 * G + 16 * b));
            q[i] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(c, 4), c), lo);
        }
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(x[j].q + 256 * G + 32 * b));
            const __m256 dx = _mm256_broadcast_ss(x[j].d + 8 * G + b);
            #pragma GCC unroll 4
            for (int i = 0; i < M; i++) {
                const __m256 sc = _mm256_mul_ps(_mm256_broadcast_ss(dw[i] + b), dx);
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DPBUSD(_mm256_setzero_si256(), q[i], v)), sc, acc[i][j]);
            }
        }
    }
    #pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        const __m256 s = _mm256_loadu_ps(x[j].s + 8 * G), e = _mm256_loadu_ps(x[j].e + 8 * G);
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++) acc[i][j] = _mm256_fmadd_ps(zd[i], e, _mm256_fmadd_ps(mv[i], s, acc[i][j]));
    }
}

/* y[r0 + j][n0 + i] (+)= W[n0 + i] . x[r0 + j], i < M, j < N */
INLINE void tile_q4(const proj_q4 *p, int n0, const int M, qact a, int r0, const int N, float *y,
                    int ystride, int accumulate) {
    const int nb = p->k / QK, G = nb / GB, t = nb % GB;
    q4row w[4];
    qact x[4];
    __m256 acc[4][4];
    #pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        w[i] = q4_row(p, n0 + i);
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) acc[i][j] = _mm256_setzero_ps();
    }
    #pragma GCC unroll 4
    for (int j = 0; j < N; j++) x[j] = row_of(a, r0 + j, p->k);
    for (int g = 0; g < G; g++) group_q4(w, M, x, N, g, acc);
    if (t) tail_q4(w, M, x, N, G, t, acc);
    #pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        __m256 v[4];
        float rest[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++) v[i] = i < M ? outliers(p, n0 + i, &x[j], acc[i][j], rest + i) : _mm256_setzero_ps();
        put_m(y + (size_t)(r0 + j) * ystride + n0, _mm_add_ps(hsum4x8(v[0], v[1], v[2], v[3]), _mm_loadu_ps(rest)), M,
              accumulate);
    }
}

typedef struct { const uint8_t *d, *c; } q8row;

INLINE q8row q8_row(const proj_q8 *p, int n) {
    const size_t nb = p->k / QK;
    const uint8_t *w = p->w + (size_t)n * 34 * nb;
    const q8row r = { w, w + 2 * nb };
    return r;
}

/* the head's group_q4: acc += idot * (dw * dx) */
INLINE void group_q8(const q8row *w, const int M, const qact *x, const int N, const int g, __m256 acc[4][4]) {
    __m256 dv[4];
    __m256i iacc[4][4];
    #pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        dv[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[i].d + 16 * g)));
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) iacc[i][j] = _mm256_setzero_si256();
    }
    #pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        __m256i q[4];
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++) q[i] = _mm256_loadu_si256((const __m256i *)(w[i].c + 256 * g + 32 * k));
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(x[j].q + 256 * g + 32 * k));
            #pragma GCC unroll 4
            for (int i = 0; i < M; i++) iacc[i][j] = HDOT(iacc[i][j], q[i], v);
        }
    }
    #pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        const __m256 dx = _mm256_loadu_ps(x[j].d + 8 * g);
        const __m256i sum = _mm256_loadu_si256((const __m256i *)(x[j].u + 8 * g));
        (void)sum;
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++)
            acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(HFIX(iacc[i][j], sum)), _mm256_mul_ps(dv[i], dx), acc[i][j]);
    }
}

/* the head's tail_q4: the last t blocks' codes signed, in order, each block's dot as eight lanes
   of partial sums (the sign trick: |q| against v with q's sign) scaled by its (dw * dx) */
INLINE void tail_q8(const q8row *w, const int M, const qact *x, const int N, const int G, const int t,
                    __m256 acc[4][4]) {
    float dw[4][GB];
    #pragma GCC unroll 4
    for (int i = 0; i < M; i++)
        _mm256_storeu_ps(dw[i], _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w[i].d + 16 * G))),
                                              _mm256_castsi256_ps(lanes_below(t))));
    for (int b = 0; b < t; b++) {
        __m256i q[4], aq[4];
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            q[i] = _mm256_loadu_si256((const __m256i *)(w[i].c + 256 * G + 32 * b));
            aq[i] = _mm256_sign_epi8(q[i], q[i]);
        }
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(x[j].q + 256 * G + 32 * b));
            const __m256 dx = _mm256_broadcast_ss(x[j].d + 8 * G + b);
            #pragma GCC unroll 4
            for (int i = 0; i < M; i++) {
                const __m256i p = DPBUSD(_mm256_setzero_si256(), aq[i], _mm256_sign_epi8(v, q[i]));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(_mm256_broadcast_ss(dw[i] + b), dx), acc[i][j]);
            }
        }
    }
}

INLINE void tile_q8(const proj_q8 *p, int n0, const int M, qact a, int r0, const int N, float *y) {
    const int nb = p->k / QK, G = nb / GB, t = nb % GB;
    q8row w[4];
    qact x[4];
    __m256 acc[4][4];
    #pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        w[i] = q8_row(p, n0 + i);
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) acc[i][j] = _mm256_setzero_ps();
    }
    #pragma GCC unroll 4
    for (int j = 0; j < N; j++) x[j] = row_of(a, r0 + j, p->k);
    for (int g = 0; g < G; g++) group_q8(w, M, x, N, g, acc);
    if (t) tail_q8(w, M, x, N, G, t, acc);
    #pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        __m256 v[4];
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++) v[i] = i < M ? acc[i][j] : _mm256_setzero_ps();
        put_m(y + (size_t)(r0 + j) * p->n + n0, hsum4x8(v[0], v[1], v[2], v[3]), M, 0);
    }
}

/* each tile shape its own function, the loops above unrolled for it */
typedef void (*tile_q4_fn)(const proj_q4 *, int, qact, int, float *, int, int);
typedef void (*tile_q8_fn)(const proj_q8 *, int, qact, int, float *);
#define TILES(M)                                                                                  \
    static void tile_q4_##M##_1(const proj_q4 *p, int n, qact a, int r, float *y, int ys, int ac) { tile_q4(p, n, M, a, r, 1, y, ys, ac); } \
    static void tile_q4_##M##_2(const proj_q4 *p, int n, qact a, int r, float *y, int ys, int ac) { tile_q4(p, n, M, a, r, 2, y, ys, ac); } \
    static void tile_q4_##M##_3(const proj_q4 *p, int n, qact a, int r, float *y, int ys, int ac) { tile_q4(p, n, M, a, r, 3, y, ys, ac); } \
    static void tile_q4_##M##_4(const proj_q4 *p, int n, qact a, int r, float *y, int ys, int ac) { tile_q4(p, n, M, a, r, 4, y, ys, ac); } \
    static void tile_q8_##M##_1(const proj_q8 *p, int n, qact a, int r, float *y) { tile_q8(p, n, M, a, r, 1, y); } \
    static void tile_q8_##M##_2(const proj_q8 *p, int n, qact a, int r, float *y) { tile_q8(p, n, M, a, r, 2, y); } \
    static void tile_q8_##M##_3(const proj_q8 *p, int n, qact a, int r, float *y) { tile_q8(p, n, M, a, r, 3, y); } \
    static void tile_q8_##M##_4(const proj_q8 *p, int n, qact a, int r, float *y) { tile_q8(p, n, M, a, r, 4, y); }
TILES(1)
TILES(2)
TILES(3)
TILES(4)
static const tile_q4_fn TILE_Q4[4][4] = {
    {tile_q4_1_1, tile_q4_1_2, tile_q4_1_3, tile_q4_1_4}, {tile_q4_2_1, tile_q4_2_2, tile_q4_2_3, tile_q4_2_4},
    {tile_q4_3_1, tile_q4_3_2, tile_q4_3_3, tile_q4_3_4}, {tile_q4_4_1, tile_q4_4_2, tile_q4_4_3, tile_q4_4_4}};
static const tile_q8_fn TILE_Q8[4][4] = {
    {tile_q8_1_1, tile_q8_1_2, tile_q8_1_3, tile_q8_1_4}, {tile_q8_2_1, tile_q8_2_2, tile_q8_2_3, tile_q8_2_4},
    {tile_q8_3_1, tile_q8_3_2, tile_q8_3_3, tile_q8_3_4}, {tile_q8_4_1, tile_q8_4_2, tile_q8_4_3, tile_q8_4_4}};

/* weight rows a tile takes: 4 while few activation rows share each weight load, else 2 (two
   rows of weights by four of activations keep their accumulators in registers) */
static inline int tile_rows(int rows) { return rows < 4 ? 4 : 2; }

/* y[r][n] (+)= W[n] . x[r] for every row r: tiles of weight rows split across threads, each
   meeting the activation rows four at a time */
/* the bytes [from, from + n) on their way into the cache */
static inline void prefetch(const uint8_t *from, size_t n, const uint8_t *end) {
    if (from + n > end) n = from < end ? (size_t)(end - from) : 0;
    for (size_t i = 0; i < n; i += 64) _mm_prefetch((const char *)from + i, _MM_HINT_T0);
}

/* how far ahead of a tile its thread asks for the weight rows it will read next: the rows
   stream from memory once a step (decode at batch 1 is bound by it), and the hardware's
   prefetcher alone left the loads waiting (one thread: 126 -> 194 tokens/s at batch 1) */
#define PREFETCH_BYTES 4096

/* activation rows a pass over the weights takes: a long prefill's rows (their codes and scales)
   would not stay in a core's L2 over the whole pass */
#ifndef ROW_CHUNK
#define ROW_CHUNK 64
#endif

/* the first bytes of this thread's share of the next projection's rows (n rows of `row` bytes,
   tiles of MT rows split as schedule(static) splits them), asked for while it waits for the
   other threads: its stream starts warm */
typedef struct { const uint8_t *w; int n; size_t row; } next_t;

static void warm(next_t next, int MT) {
    if (!next.w) return;
    const int tiles = (next.n + MT - 1) / MT, nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int q = tiles / nt, rem = tiles % nt, first = id < rem ? (q + 1) * id : q * id + rem;
    const uint8_t *end = next.w + next.row * next.n;
    prefetch(next.w + (size_t)first * MT * next.row, PREFETCH_BYTES, end);
}

static next_t next_q4(const proj_q4 *p) { const next_t n = { p->w, p->n, (size_t)21 * (p->k / QK) }; return n; }
static next_t next_q8(const proj_q8 *p) { const next_t n = { p->w, p->n, (size_t)34 * (p->k / QK) }; return n; }

static void matmul_q4(const proj_q4 *p, int rows, qact a, float *y, int ystride, int accumulate, next_t next) {
    const int MT = tile_rows(rows), tiles = (p->n + MT - 1) / MT;
    const size_t row = (size_t)21 * (p->k / QK);
    const uint8_t *end = p->w + row * p->n;
    for (int r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
        const int r1 = rows - r0 < ROW_CHUNK ? rows : r0 + ROW_CHUNK;
        #pragma omp for schedule(static) nowait
        for (int i = 0; i < tiles; i++) {
            const int n0 = i * MT, m = p->n - n0 < MT ? p->n - n0 : MT;
            prefetch(p->w + n0 * row + PREFETCH_BYTES, MT * row, end);
            for (int r = r0; r < r1; r += 4)
                TILE_Q4[m - 1][(r1 - r < 4 ? r1 - r : 4) - 1](p, n0, a, r, y, ystride, accumulate);
        }
    }
    warm(next, MT);
    #pragma omp barrier
}

static void matmul_q8(const proj_q8 *p, int rows, qact a, float *y) {
    const int MT = tile_rows(rows), tiles = (p->n + MT - 1) / MT;
    const size_t row = (size_t)34 * (p->k / QK);
    const uint8_t *end = p->w + row * p->n;
    #pragma omp for schedule(static)
    for (int i = 0; i < tiles; i++) {
        const int n0 = i * MT, m = p->n - n0 < MT ? p->n - n0 : MT;
        prefetch(p->w + n0 * row + PREFETCH_BYTES, MT * row, end);
        for (int r = 0; r < rows; r += 4)
            TILE_Q8[m - 1][(rows - r < 4 ? rows - r : 4) - 1](p, n0, a, r, y);
    }
}

/* ---- the scalar reference: the same arithmetic one lane and one element at a time, from the
   layout's definition (tests check the tiles against it bit for bit) ---- */

static float f16_at(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

/* in a row of nb blocks: element e's code of block b (q4: 4-bit; q8: stored byte) and the
   activation's; whole groups by lanes (vector e/4 of the group, lane b % 8), the short last
   group's blocks in order */
static int short_block(int nb, int b) { return b >= nb / GB * GB; }

static int q4_code(const uint8_t *c, int nb, int b, int e) {
    const size_t g = b / GB, j = b % GB;
    const int byte = e % 16;
    const uint8_t v = short_block(nb, b) ? c[g * 128 + 16 * j + byte] : c[g * 128 + 32 * (byte / 4) + 4 * j + byte % 4];
    return e < 16 ? v & 15 : v >> 4;
}

static int q8_code(const uint8_t *c, int nb, int b, int e) {
    const size_t g = b / GB, j = b % GB;
    return short_block(nb, b) ? (int8_t)c[g * 256 + 32 * j + e] : (int)c[g * 256 + 32 * (e / 4) + 4 * j + e % 4] - 128;
}

static int act_code(const qact *x, int nb, int b, int e) {
    const size_t g = b / GB, j = b % GB;
    return short_block(nb, b) ? x->q[g * 256 + 32 * j + e] : x->q[g * 256 + 32 * (e / 4) + 4 * j + e % 4];
}

static float hsum8_ref(const float *v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

/* the integer dot of block b, whole or as eight lanes of four elements' partial sums */
static int block_dot(const uint8_t *c, int q8, int nb, int b, const qact *x, int lane) {
    int sum = 0;
    for (int e = lane < 0 ? 0 : 4 * lane; e < (lane < 0 ? QK : 4 * lane + 4); e++)
        sum += (q8 ? q8_code(c, nb, b, e) : q4_code(c, nb, b, e)) * act_code(x, nb, b, e);
    return sum;
}

static float ref_q4(const proj_q4 *p, int n, const qact *x) {
    const int nb = p->k / QK, G = nb / GB;
    const q4row w = q4_row(p, n);
    float acc[GB] = {0};
    for (int g = 0; g < groups_of(p->k); g++) {
        if (g == G)                                     /* the short group's blocks, lane by lane */
            for (int b = 8 * G; b < nb; b++)
                for (int l = 0; l < GB; l++)
                    acc[l] = fmaf((float)block_dot(w.c, 0, nb, b, x, l), f16_at(w.d + 2 * b) * x->d[b], acc[l]);
        for (int l = 0; l < GB; l++) {
            const int b = 8 * g + l;
            float d = 0.f, m = 0.f, zd = 0.f;
            if (b < nb) {
                d = f16_at(w.d + 2 * b);
                m = f16_at(w.m + 2 * b);
                zd = (float)w.z[b] * d;
            }
            if (g < G) acc[l] = fmaf((float)block_dot(w.c, 0, nb, b, x, -1), d * x->d[b], acc[l]);
            acc[l] = fmaf(m, x->s[b], acc[l]);
            acc[l] = fmaf(zd, x->e[b], acc[l]);
        }
    }
    const float *ow = p->out_w + (size_t)n * p->n_out;
    int j = 0;
    for (; j + 8 <= p->n_out; j += 8)
        for (int l = 0; l < 8; l++) acc[l] = fmaf(ow[j + l], x->xo[j + l], acc[l]);
    float rest = 0.f;
    for (; j < p->n_out; j++) rest += ow[j] * x->xo[j];
    return hsum8_ref(acc) + rest;
}

static float ref_q8(const proj_q8 *p, int n, const qact *x) {
    const int nb = p->k / QK, G = nb / GB;
    const q8row w = q8_row(p, n);
    float acc[GB] = {0};
    for (int b = 0; b < nb; b++) {
        const float sc = f16_at(w.d + 2 * b) * x->d[b];
        if (b < 8 * G) acc[b % GB] = fmaf((float)block_dot(w.c, 1, nb, b, x, -1), sc, acc[b % GB]);
        else for (int l = 0; l < GB; l++) acc[l] = fmaf((float)block_dot(w.c, 1, nb, b, x, l), sc, acc[l]);
    }
    return hsum8_ref(acc);
}

/* the activations' part of the scratch: rows of width up to k */
static float *act_layout(float *at, int rows, int k, qact *a) {
    const size_t nbp = (size_t)groups_of(k) * GB;
    a->q = (int8_t *)at;
    a->d = at + (size_t)rows * nbp * QK / 4;
    a->s = a->d + (size_t)rows * nbp;
    a->e = a->s + (size_t)rows * nbp;
    a->u = (int32_t *)(a->e + (size_t)rows * nbp);
    a->xo = (float *)(a->u + (size_t)rows * nbp);
    return a->xo + (size_t)rows * OUT_MAX;
}

static long act_floats(int rows, int k) {
    return (long)rows * ((long)groups_of(k) * GB * (QK / 4 + 4) + OUT_MAX);
}

/* For tests: y = W x for `rows` rows of x ([rows][k] float32), through the tiles (on `threads`
   threads) into fast and through the scalar reference into ref ([rows][n] each); scratch:
   act_floats(rows, k) floats. head: p is a proj_q8, else a proj_q4. */
long check_scratch_floats(int rows, int k) { return act_floats(rows, k); }

void check_matmul(const void *p, int head, int rows, const float *x, float *fast, float *ref,
                  float *scratch, int threads) {
    const proj_q4 *p4 = p;
    const proj_q8 *p8 = p;
    const int k = head ? p8->k : p4->k, n = head ? p8->n : p4->n;
    qact a;
    act_layout(scratch, rows, k, &a);
    for (int r = 0; r < rows; r++)
        quantize_row(x + (size_t)r * k, k, head ? NULL : p4->out_idx, head ? 0 : p4->n_out, row_of(a, r, k));
    #pragma omp parallel num_threads(threads)
    {
        if (head) matmul_q8(p8, rows, a, fast);
        else matmul_q4(p4, rows, a, fast, n, 0, (next_t){0});
    }
    for (int r = 0; r < rows; r++) {
        const qact x1 = row_of(a, r, k);
        for (int i = 0; i < n; i++)
            ref[(size_t)r * n + i] = head ? ref_q8(p8, i, &x1) : ref_q4(p4, i, &x1);
    }
}


static void rmsnorm(const float *x, const float *g, float *out, int dim, float eps) {
    const float inv = 1.f / sqrtf(dot(x, x, dim) / dim + eps);
    for (int i = 0; i < dim; i++) out[i] = x[i] * inv * g[i];
}

/* rotate_half RoPE of `heads` heads of v at position pos */
static void rope(float *v, int heads, int hd, const float *inv_freq, int64_t pos) {
    for (int i = 0; i < hd / 2; i++) {
        const float f = (float)pos * inv_freq[i], c = cosf(f), s = sinf(f);
        for (int h = 0; h < heads; h++) {
            float *u = v + h * hd;
            const float a = u[i], b = u[i + hd / 2];
            u[i] = a * c - b * s;
            u[i + hd / 2] = b * c + a * s;
        }
    }
}

static inline float *pool_block(const step_t *s, const model_t *m, int layer, int kv, int64_t block, int head) {
    const size_t i = (((size_t)layer * 2 + kv) * s->num_blocks + block) * m->kv_heads + head;
    return s->pool + i * s->block_size * m->head_dim;
}

/* q . k for four keys (k0..k3: hd floats each): per key the same operations in the same order
   whatever the other three are, so a key's score does not depend on the keys beside it */
static inline __m128 dot4(const float *q, const float *k0, const float *k1, const float *k2,
                          const float *k3, int hd) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 8 <= hd; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    for (; i < hd; i++) {
        const __m128 qs = _mm_set1_ps(q[i]);
        r = _mm_add_ps(r, _mm_mul_ps(qs, _mm_setr_ps(k0[i], k1[i], k2[i], k3[i])));
    }
    return r;
}

/* one query head over the row's cached tokens (and its own, already in the pool): the scores
   four keys at a time, the softmax eight at a time, and the weighted sum of the values with a
   chunk of 64 of the output's elements held in registers over all the keys */
static void attend(const model_t *m, const step_t *s, int layer, int r, int kh, const float *q,
                   float *out, float *scores) {
    const int hd = m->head_dim, BS = s->block_size, n = s->ctx[r];
    const int64_t *table = s->tables + (size_t)s->seq[r] * s->width;
    const __m128 scale = _mm_set1_ps(1.f / sqrtf((float)hd));
    for (int t0 = 0; t0 < n; t0 += BS) {
        const float *k = pool_block(s, m, layer, 0, table[t0 / BS], kh);
        const int cnt = n - t0 < BS ? n - t0 : BS;
        int u = 0;
        for (; u + 4 <= cnt; u += 4)
            _mm_storeu_ps(scores + t0 + u, _mm_mul_ps(dot4(q, k + u * hd, k + (u + 1) * hd, k + (u + 2) * hd,
                                                           k + (u + 3) * hd, hd), scale));
        for (; u < cnt; u++) {
            const float *ku = k + u * hd;
            scores[t0 + u] = _mm_cvtss_f32(_mm_mul_ps(dot4(q, ku, ku, ku, ku, hd), scale));
        }
    }
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 best = _mm256_set1_ps(-INFINITY), total = _mm256_setzero_ps();
    for (int t = 0; t < n; t += 8) {
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - t), iota);
        best = _mm256_max_ps(best, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(scores + t, keep),
                                                    _mm256_castsi256_ps(keep)));
    }
    __m128 b4 = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
    b4 = _mm_max_ps(b4, _mm_movehl_ps(b4, b4));
    b4 = _mm_max_ss(b4, _mm_movehdup_ps(b4));
    const __m256 bv = _mm256_set1_ps(_mm_cvtss_f32(b4));
    for (int t = 0; t < n; t += 8) {
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - t), iota);
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(scores + t, keep), bv)),
                                       _mm256_castsi256_ps(keep));
        _mm256_maskstore_ps(scores + t, keep, e);
        total = _mm256_add_ps(total, e);
    }
    const __m256 tv = _mm256_set1_ps(hsum8(total));
    for (int t = 0; t < n; t += 8) {
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - t), iota);
        _mm256_maskstore_ps(scores + t, keep, _mm256_div_ps(_mm256_maskload_ps(scores + t, keep), tv));
    }
    int c = 0;
    for (; c + 64 <= hd; c += 64) {                 /* 64 elements: eight registers */
        __m256 acc[8];
        #pragma GCC unroll 8
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int t0 = 0; t0 < n; t0 += BS) {
            const float *v = pool_block(s, m, layer, 1, table[t0 / BS], kh) + c;
            const int cnt = n - t0 < BS ? n - t0 : BS;
            for (int u = 0; u < cnt; u++) {
                const __m256 pv = _mm256_broadcast_ss(scores + t0 + u);
                #pragma GCC unroll 8
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + u * hd + 8 * i), acc[i]);
            }
        }
        #pragma GCC unroll 8
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + c + 8 * i, acc[i]);
    }
    for (; c + 8 <= hd; c += 8) {                   /* then eight at a time */
        __m256 acc = _mm256_setzero_ps();
        for (int t0 = 0; t0 < n; t0 += BS) {
            const float *v = pool_block(s, m, layer, 1, table[t0 / BS], kh) + c;
            const int cnt = n - t0 < BS ? n - t0 : BS;
            for (int u = 0; u < cnt; u++) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(scores + t0 + u), _mm256_loadu_ps(v + u * hd), acc);
        }
        _mm256_storeu_ps(out + c, acc);
    }
    for (int i = hd / 8 * 8; i < hd; i++) {         /* elements past the last whole vector */
        float o = 0.f;
        for (int t = 0; t < n; t++) o += scores[t] * pool_block(s, m, layer, 1, table[t / BS], kh)[(t % BS) * hd + i];
        out[i] = o;
    }
}

/* each row of x normed into h and rounded for the projection p (rows split across threads) */
static void norm_rows(const model_t *m, const float *x, const float *gamma, float *h, int rows,
                      const proj_q4 *p, qact a) {
    const int D = m->dim;
    #pragma omp for
    for (int r = 0; r < rows; r++) {
        rmsnorm(x + (size_t)r * D, gamma, h + (size_t)r * D, D, m->eps);
        quantize_row(h + (size_t)r * D, D, p->out_idx, p->n_out, row_of(a, r, D));
    }
}

static int widest(const model_t *m) {
    const int q = (m->heads + 2 * m->kv_heads) * m->head_dim;
    return 2 * m->ffn > q ? 2 * m->ffn : q;
}

static int act_width(const model_t *m) { return m->dim > m->ffn ? m->dim : m->ffn; }

/* floats of scratch a step of `rows` tokens attending to at most `max_ctx` needs */
long step_scratch_floats(const model_t *m, int rows, int max_ctx, int threads) {
    const long D = m->dim, F = m->ffn;
    return rows * (3 * D + widest(m) + F)              /* x, h, attn, wide, mlp */
         + act_floats(rows, act_width(m))              /* int8 codes; d, s, e, sums; outliers */
         + (long)threads * max_ctx;                     /* scores */
}

void step(const model_t *m, const step_t *s) {
    const int R = s->rows, D = m->dim, H = m->heads, KVH = m->kv_heads, hd = m->head_dim;
    const int F = m->ffn, G = H / KVH, W = widest(m), A = act_width(m);
    float *x = s->scratch, *h = x + (size_t)R * D, *attn = h + (size_t)R * D;
    float *wide = attn + (size_t)R * D, *mlp = wide + (size_t)R * W;
    qact a;
    float *per_thread = act_layout(mlp + (size_t)R * F, R, A, &a);

    #pragma omp parallel num_threads(s->threads)
    {
        float *scores = per_thread + (size_t)omp_get_thread_num() * s->max_ctx;
        #pragma omp for
        for (int r = 0; r < R; r++)
            memcpy(x + (size_t)r * D, m->embed + (size_t)s->tokens[r] * D, sizeof(float) * D);

        for (int l = 0; l < m->layers; l++) {
            const proj_q4 *qkv = m->qkv + l, *o = m->o + l, *gu = m->gate_up + l, *dn = m->down + l;
            norm_rows(m, x, m->attn_norm + (size_t)l * D, h, R, qkv, a);
            matmul_q4(qkv, R, a, wide, W, 0, next_q4(o));
            #pragma omp for
            for (int r = 0; r < R; r++) {          /* RoPE, then the token's K/V into the pool */
                float *v = wide + (size_t)r * W;
                rope(v, H + KVH, hd, m->inv_freq, s->positions[r]);
                const int64_t blk = s->slots[r] / s->block_size;
                const int off = (int)(s->slots[r] % s->block_size);
                for (int kh = 0; kh < KVH; kh++) {
                    memcpy(pool_block(s, m, l, 0, blk, kh) + off * hd, v + (H + kh) * hd, sizeof(float) * hd);
                    memcpy(pool_block(s, m, l, 1, blk, kh) + off * hd, v + (H + KVH + kh) * hd, sizeof(float) * hd);
                }
            }
            #pragma omp for schedule(dynamic)
            for (int i = 0; i < R * H; i++) {            /* a task per query head */
                const int r = i / H, qh = i % H;
                attend(m, s, l, r, qh / G, wide + (size_t)r * W + qh * hd, attn + (size_t)r * D + qh * hd, scores);
            }
            #pragma omp for
            for (int r = 0; r < R; r++)
                quantize_row(attn + (size_t)r * D, D, o->out_idx, o->n_out, row_of(a, r, D));
            matmul_q4(o, R, a, x, D, 1, next_q4(gu));    /* into the residual */
            norm_rows(m, x, m->mlp_norm + (size_t)l * D, h, R, gu, a);
            matmul_q4(gu, R, a, wide, W, 0, next_q4(dn));
            #pragma omp for
            for (int r = 0; r < R; r++) {
                const float *g = wide + (size_t)r * W, *u = g + F;
                float *y = mlp + (size_t)r * F;
                swiglu(g, u, y, F);
                quantize_row(y, F, dn->out_idx, dn->n_out, row_of(a, r, F));
            }
            matmul_q4(dn, R, a, x, D, 1, l + 1 < m->layers ? next_q4(m->qkv + l + 1) : next_q8(&m->head));
        }
        #pragma omp for
        for (int i = 0; i < s->n_logits; i++) {
            rmsnorm(x + (size_t)s->logit_rows[i] * D, m->final_norm, h + (size_t)i * D, D, m->eps);
            quantize_row(h + (size_t)i * D, D, NULL, 0, row_of(a, i, D));
        }
        matmul_q8(&m->head, s->n_logits, a, s->logits);
    }
}


/* for benchmarks: seconds of the fastest of `reps` matmuls of `rows` rows through the tiles */
double bench_matmul(const proj_q4 *p, int rows, const float *x, float *y, float *scratch, int threads, int reps) {
    qact a;
    act_layout(scratch, rows, p->k, &a);
    for (int r = 0; r < rows; r++)
        quantize_row(x + (size_t)r * p->k, p->k, p->out_idx, p->n_out, row_of(a, r, p->k));
    double best = 1e30;
    for (int i = 0; i < reps; i++) {
        const double t = omp_get_wtime();
        #pragma omp parallel num_threads(threads)
        matmul_q4(p, rows, a, y, p->n, 0, (next_t){0});
        const double dt = omp_get_wtime() - t;
        if (dt < best) best = dt;
    }
    return best;
}
