/* One forward step of a Llama model on block-quantised weights, for the CPU: every op of every
 * layer inside one OpenMP parallel region, so an op costs a barrier, not a dispatch.
 *
 * Weights are GGUF's blocks as they are: Q4_1 projections (fp16 d and m, 4-bit codes q,
 * w = d*q + m, elements j and j + 16 in one byte) and a Q8_0 head. Activations are rounded to
 * int8 per block of 32 before they meet the codes (as llama.cpp's Q8_1 and ONNX Runtime's
 * accuracy level 4 do), with the two exact rewrites of the ONNX path (twophase/exporters/q4.py):
 *  - centred zero points: w = d*(q - z) + (m + z*d) with z near -m/d, so the int8 rounding error
 *    meets weights near their true values; the integer dot is the same, and the correction is
 *    z*d times the block's rounding error, e = sum(x) - dx*sum(xq), known per activation block;
 *  - outlier channels: a few input channels are zeroed before the rounding and multiplied in
 *    float32 by their own weights.
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

/* the integer dot of 32 unsigned codes with 32 signed ones, as eight int32 sums of four: one
   VNNI instruction where the CPU has it, else two AVX2 ones (no saturation either way: a q4 code
   times an int8 is at most 15 * 127, a pair of |q8| * |int8| at most 2 * 127 * 127) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define IDOT(q, v) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (q), (v))
#elif defined(__AVXVNNI__)
#define IDOT(q, v) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (q), (v))
#else
#define IDOT(q, v) _mm256_madd_epi16(_mm256_maddubs_epi16((q), (v)), _mm256_set1_epi16(1))
#endif

typedef struct { uint16_t d, m; uint8_t qs[16]; } block_q4_1;
typedef struct { uint16_t d; int8_t qs[32]; } block_q8_0;

typedef struct {
    int n, k, n_out;
    const block_q4_1 *w;    /* [n][k/32] */
    const uint8_t *z;       /* [n][k/32] zero points */
    const int32_t *out_idx; /* [n_out] outlier input channels */
    const float *out_w;     /* [n][n_out] their weights */
} proj_q4;

typedef struct { int n, k; const block_q8_0 *w; } proj_q8;

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

/* a row's activations, rounded: int8 codes, and per block the step, the float sum and the
   rounding error of the sum; the outlier channels' float values */
typedef struct { int8_t *q; float *d, *s, *e, *xo; } qact;

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
    const int nb = k / QK;
    qact out = { a.q + (size_t)r * k, a.d + (size_t)r * nb, a.s + (size_t)r * nb,
                 a.e + (size_t)r * nb, a.xo + (size_t)r * OUT_MAX };
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
    for (int i = 0; i < n_out; i++) a.xo[i] = x[idx[i]];
    for (int b = 0; b < k / QK; b++) {
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
        codes_32(v, id, a.q + b * QK, &qsum);
        a.d[b] = d;
        a.s[b] = fsum;
        a.e[b] = fsum - d * (float)hsum8i(qsum);
    }
}

/* the outlier channels' float term, added to a row's accumulators */
static inline float finish(const proj_q4 *p, int n, const qact *x, __m256 acc, float rest) {
    const float *ow = p->out_w + (size_t)n * p->n_out;
    int j = 0;
    for (; j + 8 <= p->n_out; j += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(ow + j), _mm256_loadu_ps(x->xo + j), acc);
    for (; j < p->n_out; j++) rest += ow[j] * x->xo[j];
    return hsum8(acc) + rest;
}

/* W[n] . x[r]: one weight row against one activation row (decode at batch 1: keep it lean) */
static inline float dot_row_q4(const proj_q4 *p, int n, qact x) {
    const int nb = p->k / QK;
    const block_q4_1 *w = p->w + (size_t)n * nb;
    const uint8_t *z = p->z + (size_t)n * nb;
    const __m256i lo = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    float rest = 0.f;
    for (int b = 0; b < nb; b++) {
        const __m128i t = _mm_loadu_si128((const __m128i *)w[b].qs);
        const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), lo);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(x.q + b * QK));
        const __m256i pairs = IDOT(q, v);
        const float d = h2f(w[b].d);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d[b]), _mm256_cvtepi32_ps(pairs), acc);
        rest += h2f(w[b].m) * x.s[b] + (float)z[b] * d * x.e[b];
    }
    return finish(p, n, &x, acc, rest);
}

/* W[n] . x[r0 + i] for four rows at once: each weight block is unpacked once for all four */
static inline void dot_4rows_q4(const proj_q4 *p, int n, qact a, int r0, float *out) {
    const int nb = p->k / QK;
    const block_q4_1 *w = p->w + (size_t)n * nb;
    const uint8_t *z = p->z + (size_t)n * nb;
    const __m256i lo = _mm256_set1_epi8(0x0F);
    qact x[4];
    __m256 acc[4];
    float rest[4];
    for (int i = 0; i < 4; i++) {
        x[i] = row_of(a, r0 + i, p->k);
        acc[i] = _mm256_setzero_ps();
        rest[i] = 0.f;
    }
    for (int b = 0; b < nb; b++) {
        const __m128i t = _mm_loadu_si128((const __m128i *)w[b].qs);
        const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), lo);
        const float d = h2f(w[b].d), m = h2f(w[b].m), zd = (float)z[b] * d;
        for (int i = 0; i < 4; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(x[i].q + b * QK));
            const __m256i pairs = IDOT(q, v);
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[i].d[b]), _mm256_cvtepi32_ps(pairs), acc[i]);
            rest[i] += m * x[i].s[b] + zd * x[i].e[b];
        }
    }
    for (int i = 0; i < 4; i++) out[i] = finish(p, n, &x[i], acc[i], rest[i]);
}

/* W[n + j] . x[r0 + i] for two weight rows and four activation rows: each weight block is
   unpacked once for four rows and each activation block loaded once for two weight rows; the
   minimum's and the zero point's terms of the four rows go in one vector. The same operations
   in the same order as dot_row_q4 for every (j, i), so a row's result does not depend on the
   tile it was computed in */
static inline void dot_2x4_q4(const proj_q4 *p, int n, qact a, int r0, float out[2][4]) {
    const int nb = p->k / QK;
    const block_q4_1 *w0 = p->w + (size_t)n * nb, *w1 = w0 + nb;
    const uint8_t *z0 = p->z + (size_t)n * nb, *z1 = z0 + nb;
    const __m256i lo = _mm256_set1_epi8(0x0F);
    qact x[4];
    __m256 acc0[4], acc1[4];
    __m128 rest0 = _mm_setzero_ps(), rest1 = _mm_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = row_of(a, r0 + i, p->k);
        acc0[i] = acc1[i] = _mm256_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        const __m128i t0 = _mm_loadu_si128((const __m128i *)w0[b].qs);
        const __m128i t1 = _mm_loadu_si128((const __m128i *)w1[b].qs);
        const __m256i q0 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t0, 4), t0), lo);
        const __m256i q1 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t1, 4), t1), lo);
        const float d0 = h2f(w0[b].d), d1 = h2f(w1[b].d);
        for (int i = 0; i < 4; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(x[i].q + b * QK));
            const __m256i p0 = IDOT(q0, v);
            const __m256i p1 = IDOT(q1, v);
            acc0[i] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * x[i].d[b]), _mm256_cvtepi32_ps(p0), acc0[i]);
            acc1[i] = _mm256_fmadd_ps(_mm256_set1_ps(d1 * x[i].d[b]), _mm256_cvtepi32_ps(p1), acc1[i]);
        }
        const __m128 s4 = _mm_setr_ps(x[0].s[b], x[1].s[b], x[2].s[b], x[3].s[b]);
        const __m128 e4 = _mm_setr_ps(x[0].e[b], x[1].e[b], x[2].e[b], x[3].e[b]);
        rest0 = _mm_add_ps(rest0, _mm_add_ps(_mm_mul_ps(_mm_set1_ps(h2f(w0[b].m)), s4),
                                             _mm_mul_ps(_mm_set1_ps((float)z0[b] * d0), e4)));
        rest1 = _mm_add_ps(rest1, _mm_add_ps(_mm_mul_ps(_mm_set1_ps(h2f(w1[b].m)), s4),
                                             _mm_mul_ps(_mm_set1_ps((float)z1[b] * d1), e4)));
    }
    float r0s[4], r1s[4];
    _mm_storeu_ps(r0s, rest0);
    _mm_storeu_ps(r1s, rest1);
    for (int i = 0; i < 4; i++) {
        out[0][i] = finish(p, n, &x[i], acc0[i], r0s[i]);
        out[1][i] = finish(p, n + 1, &x[i], acc1[i], r1s[i]);
    }
}

static inline void put(float *dst, float v, int accumulate) { *dst = (accumulate ? *dst : 0.f) + v; }

/* y[r][n] (+)= W[n] . x[r] for every row r; pairs of rows of W split across threads.
   Where the time goes (perf, a 512-token prefill of the default model): half of the step in
   dot_2x4_q4, and there more in the scalar work around each block's integer dot (fp16 scales,
   their products and broadcasts, the minimum's terms) than in the dot itself; the way on is a
   layout with a group of blocks' scales contiguous, each block's lanes reduced, and the scales
   applied as one vector per group */
static void matmul_q4(const proj_q4 *p, int rows, qact a, float *y, int ystride, int accumulate) {
    #pragma omp for schedule(static)
    for (int pair = 0; pair < (p->n + 1) / 2; pair++) {
        const int n = 2 * pair, two = n + 1 < p->n;
        int r = 0;
        if (two) {
            float out[2][4];
            for (; r + 4 <= rows; r += 4) {
                dot_2x4_q4(p, n, a, r, out);
                for (int i = 0; i < 4; i++) {
                    put(y + (size_t)(r + i) * ystride + n, out[0][i], accumulate);
                    put(y + (size_t)(r + i) * ystride + n + 1, out[1][i], accumulate);
                }
            }
        }
        for (int j = 0; j <= two; j++) {
            int rr = r;
            float out4[4];
            for (; rr + 4 <= rows; rr += 4) {
                dot_4rows_q4(p, n + j, a, rr, out4);
                for (int i = 0; i < 4; i++) put(y + (size_t)(rr + i) * ystride + n + j, out4[i], accumulate);
            }
            for (; rr < rows; rr++)
                put(y + (size_t)rr * ystride + n + j, dot_row_q4(p, n + j, row_of(a, rr, p->k)), accumulate);
        }
    }
}

static void matmul_q8(const proj_q8 *p, int rows, qact a, float *y) {
    const int nb = p->k / QK;
    #pragma omp for schedule(static)
    for (int n = 0; n < p->n; n++) {
        const block_q8_0 *w = p->w + (size_t)n * nb;
        for (int r = 0; r < rows; r++) {
            const qact x = row_of(a, r, p->k);
            __m256 acc = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)w[b].qs);
                const __m256i v = _mm256_loadu_si256((const __m256i *)(x.q + b * QK));
                const __m256i pairs = IDOT(_mm256_sign_epi8(q, q), _mm256_sign_epi8(v, q));
                acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(w[b].d) * x.d[b]), _mm256_cvtepi32_ps(pairs), acc);
            }
            y[(size_t)r * p->n + n] = hsum8(acc);
        }
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

/* one query head over the row's cached tokens (and its own, already in the pool) */
static void attend(const model_t *m, const step_t *s, int layer, int r, int kh, const float *q,
                   float *out, float *scores) {
    const int hd = m->head_dim, BS = s->block_size, n = s->ctx[r];
    const int64_t *table = s->tables + (size_t)s->seq[r] * s->width;
    const float scale = 1.f / sqrtf((float)hd);
    float best = -INFINITY, total = 0.f;
    for (int t0 = 0; t0 < n; t0 += BS) {
        const float *k = pool_block(s, m, layer, 0, table[t0 / BS], kh);
        for (int u = 0; u < BS && t0 + u < n; u++) {
            scores[t0 + u] = dot(q, k + u * hd, hd) * scale;
            best = fmaxf(best, scores[t0 + u]);
        }
    }
    for (int t = 0; t < n; t++) { scores[t] = expf(scores[t] - best); total += scores[t]; }
    memset(out, 0, sizeof(float) * hd);
    for (int t0 = 0; t0 < n; t0 += BS) {
        const float *v = pool_block(s, m, layer, 1, table[t0 / BS], kh);
        for (int u = 0; u < BS && t0 + u < n; u++) axpy(out, scores[t0 + u] / total, v + u * hd, hd);
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
    const long D = m->dim, F = m->ffn, A = act_width(m);
    return rows * (3 * D + widest(m) + F)              /* x, h, attn, wide, mlp */
         + rows * (A / 4 + 1 + 3 * (A / QK) + OUT_MAX)  /* int8 codes; d, s, e; outliers */
         + (long)threads * max_ctx;                     /* scores */
}

void step(const model_t *m, const step_t *s) {
    const int R = s->rows, D = m->dim, H = m->heads, KVH = m->kv_heads, hd = m->head_dim;
    const int F = m->ffn, G = H / KVH, W = widest(m), A = act_width(m);
    float *x = s->scratch, *h = x + (size_t)R * D, *attn = h + (size_t)R * D;
    float *wide = attn + (size_t)R * D, *mlp = wide + (size_t)R * W;
    float *rest = mlp + (size_t)R * F;
    qact a;
    a.q = (int8_t *)rest;
    a.d = rest + (size_t)R * (A / 4 + 1);
    a.s = a.d + (size_t)R * (A / QK);
    a.e = a.s + (size_t)R * (A / QK);
    a.xo = a.e + (size_t)R * (A / QK);
    float *per_thread = a.xo + (size_t)R * OUT_MAX;

    #pragma omp parallel num_threads(s->threads)
    {
        float *scores = per_thread + (size_t)omp_get_thread_num() * s->max_ctx;
        #pragma omp for
        for (int r = 0; r < R; r++)
            memcpy(x + (size_t)r * D, m->embed + (size_t)s->tokens[r] * D, sizeof(float) * D);

        for (int l = 0; l < m->layers; l++) {
            const proj_q4 *qkv = m->qkv + l, *o = m->o + l, *gu = m->gate_up + l, *dn = m->down + l;
            norm_rows(m, x, m->attn_norm + (size_t)l * D, h, R, qkv, a);
            matmul_q4(qkv, R, a, wide, W, 0);
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
            matmul_q4(o, R, a, x, D, 1);             /* into the residual */
            norm_rows(m, x, m->mlp_norm + (size_t)l * D, h, R, gu, a);
            matmul_q4(gu, R, a, wide, W, 0);
            #pragma omp for
            for (int r = 0; r < R; r++) {
                const float *g = wide + (size_t)r * W, *u = g + F;
                float *y = mlp + (size_t)r * F;
                swiglu(g, u, y, F);
                quantize_row(y, F, dn->out_idx, dn->n_out, row_of(a, r, F));
            }
            matmul_q4(dn, R, a, x, D, 1);            /* into the residual */
        }
        #pragma omp for
        for (int i = 0; i < s->n_logits; i++) {
            rmsnorm(x + (size_t)s->logit_rows[i] * D, m->final_norm, h + (size_t)i * D, D, m->eps);
            quantize_row(h + (size_t)i * D, D, NULL, 0, row_of(a, i, D));
        }
        matmul_q8(&m->head, s->n_logits, a, s->logits);
    }
}

