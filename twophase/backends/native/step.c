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
 * The kernels work on groups of 16 blocks, one block per 32-bit lane: the codes are laid out so
 * that lane j of the group's k-th 64-byte vector holds elements 4k..4k+3 of block j, for weights
 * and activations alike. Int8 dots (VNNI vpdpbusd) then leave each block's exact integer dot in
 * its own lane, with no horizontal sum; the group's scales are one fp16 vector, and the float
 * work (the scale products, the minimum's and zero point's terms) is a few vector ops a group.
 * With AVX-512 VNNI a group is one zmm; else its two halves are ymm in turn (the same layout,
 * other per-lane sums). A row's last nb % 16 blocks are a short group, each block in order.
 *
 * Rows of a step are tokens: decodes (one per sequence) or the tokens of prefill chunks. Every
 * row writes its K/V into the pool at its slot before any row attends, so a chunk's tokens see
 * each other, causally, through the pool. Pool layout: [L, 2, NB, KVH, BS, row], a row one
 * head's vector in the pool's K/V format (float32, float16, bfloat16 or q8_0: kv_type).
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define QK 32
#define OUT_MAX 64
#define GB 16                   /* blocks in a group, one 32-bit lane each */
#define INLINE static inline __attribute__((always_inline))

/* 512-bit tiles where the compiler targets AVX-512 with VNNI: a zmm's 16 lanes halve the dots
   and float ops a block costs against a ymm's 8 (Zen 5, one thread, a 2 x 4 tile on rows in
   L1: 0.43 -> 0.26 ns a block and row at k = 576, 0.30 -> 0.17 at k = 1536) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define WIDE 1
#define LANES 16
#else
#define WIDE 0
#define LANES 8
#endif

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

/* Without VNNI a dot is three instructions (vpmaddubsw's 16-bit pairs, vpmaddwd widening them,
   an add), and the two multiplies share two pipes. Where codes are small enough that several
   products' pairs sum within 16 bits, they are added as 16-bit lanes and widened once: the same
   integers, fewer multiplies. DPBUSD2: acc + the dots of (q, v) and (r, w), codes under 64
   (2 * 2 * 63 * 127 < 32768). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
#define DPBUSD2(acc, q, v, r, w) DPBUSD(DPBUSD((acc), (q), (v)), (r), (w))
#else
#define DPBUSD2(acc, q, v, r, w) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_add_epi16( \
    _mm256_maddubs_epi16((q), (v)), _mm256_maddubs_epi16((r), (w))), _mm256_set1_epi16(1)))
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
   The codes go by groups of 16 blocks, 256 bytes: four 64-byte vectors P0..P3, lane j of Pk the
   bytes 4k..4k+3 of block j's GGUF qs (low nibbles elements 4k.., high ones 16+4k..). The last
   t = nb % 16 blocks follow in order, 16 bytes each. */
typedef struct {
    int n, k, n_out;
    const uint8_t *w;       /* [n][21 * k/32] */
    const int32_t *out_idx; /* [n_out] outlier input channels */
    const float *out_w;     /* [n][n_out] their weights */
} proj_q4;

/* The head's rows, 34*nb bytes: d[nb] fp16 | codes + 128, 32*nb bytes, by groups of 16 blocks
   as eight 64-byte vectors (lane j of the k-th: block j's bytes 4k..4k+3), the last t blocks in
   order, signed, 32 bytes each. */
typedef struct { int n, k; const uint8_t *w; } proj_q8;
typedef struct {
    int layers, dim, heads, kv_heads, head_dim, ffn, vocab;
    float eps;
    const float *embed;       /* [vocab][dim] */
    const float *attn_norm;   /* [layers][dim] */
    const float *mlp_norm;    /* [layers][dim] */
    const float *final_norm;  /* [dim] */
    const float *inv_freq;    /* [layers][rot_dim / 2]: each layer's RoPE frequencies */
    const proj_q4 *qkv, *o, *gate_up, *down;   /* [layers] each (quantization "q4") */
    proj_q8 head;
    int stored;               /* quantization "gguf": the tensors as stored, below, instead */
    const struct proj_g *s_qkv, *s_o, *s_gate_up, *s_down, *s_head;   /* [layers] each; the head */
    /* the families' departures from the Llama block (twophase/arch.py); off at 0 or NULL. The
       (1 + w) norms come folded into the norms' arrays. */
    int rot_dim;              /* the first rot_dim of a head's dimensions turn (RoPE) */
    float scale;              /* of q.k: 1/sqrt(head_dim), or the family's query scale */
    float embed_scale, attn_cap, final_cap;    /* caps: x -> cap * tanh(x / cap) */
    int act;                  /* ACT_SILU or ACT_GELU_TANH: the MLP's gate */
    const float *q_norm, *k_norm;               /* [layers][head_dim]: QK-norm */
    const float *post_attn_norm, *post_mlp_norm;    /* [layers][dim]: Gemma's norms of the outputs */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;    /* [layers][the projection's n] */
    const int32_t *window;    /* [layers] a sliding window in tokens (the query's own included), 0 full */
    const int32_t *slot, *group;    /* [layers] the pool slot and block-table group (KVGroups);
                                       NULL: slot l, group 0 */
    /* mixture-of-experts MLPs (stored formats only; every layer's, each expert ffn wide): a
       router [experts][dim], then each layer's experts' gate-and-up and down projections */
    int experts, top_k, norm_topk;
    const struct proj_g *s_router, *s_exp_gu, *s_exp_dn;   /* [layers]; [layers][experts] each */
    /* gpt-oss: each head's sink logit in every softmax's denominator, [layers][heads]; the
       router's and experts' biases, [layers][experts], [layers][experts][2 ffn] (gate's, then
       up's) and [layers][experts][dim]; the clamped SwiGLU's alpha and limit (ACT_CLAMPED) */
    const float *sinks, *router_bias, *exp_gu_bias, *exp_dn_bias;
    float glu_alpha, glu_limit;
} model_t;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_CLAMPED = 2 };

typedef struct {
    int rows;                 /* tokens in the step */
    const int64_t *tokens, *positions;           /* [rows] */
    const int64_t *slots;     /* [groups][rows] each row's slot in each group's blocks */
    const int64_t *tables;    /* [groups][seqs][width] block ids */
    int width, seqs;
    const int32_t *seq;       /* [rows] the row's sequence (its table) */
    const int32_t *ctx;       /* [rows] tokens it attends to, itself included */
    int n_logits;
    const int32_t *logit_rows;/* [n_logits] */
    void *pool; int num_blocks, block_size;
    int kv_type;              /* KV_F32, KV_F16, KV_BF16 or KV_Q8: the pool's rows (below) */
    float *logits;            /* [n_logits][vocab] */
    float *scratch;           /* step_scratch_floats() floats */
    int max_ctx;
    int threads;              /* named here: the OpenMP runtime may be torch's, set to 1 for glue;
                                 what the scratch and the attention's split are laid out for */
    int team;                 /* threads that run this step, 1..threads: fewer while other processes
                                 hold cores (thread_governor.py); the results do not depend on it */
    int amx;                  /* AMX tiles (amx_request() granted) for stored projections of this many
                                 rows or more (amx_tiles.h) and prompt chunks of as many rows'
                                 attention (amx_attention.h); 0 never */
} step_t;


/* a row's activations, rounded, by groups of 16 blocks, ACT_GROUP bytes each (one pointer a
   row reaches all of a group's fields): the int8 codes in the group's lane order (512 bytes; a
   short group's blocks in order, zeros after them), then per block the step d, the float sum s,
   the rounding error of the sum e and the sum of the codes u (16 each, zeros past the row's
   blocks); apart, the outlier channels' float values */
typedef struct { int8_t *q; float *xo; } qact;
#define ACT_GROUP 768
enum { XD = 128, XS = 144, XE = 160, XU = 176 };      /* the fields' offsets in floats */

/* group g's field f (XD..XU) of an activation row */
INLINE float *act_f(const qact *x, int g, int f) { return (float *)(x->q + (size_t)ACT_GROUP * g) + f; }

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

#ifdef __AVX512F__
/* e^x as exp8, sixteen at a time: each lane the same operations, so the same bits */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* tanh as tanh8, sixteen at a time */
static inline __m512 tanh16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 e = exp16(_mm512_add_ps(x, x));
    return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
}
#endif

/* y = silu(g) * u (SwiGLU) over n elements */
static void swiglu(const float *g, const float *u, float *y, int n) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    int i = 0;
#ifdef __AVX512F__                      /* sixteen at a time where the CPU has them: the same bits */
    for (; i + 16 <= n; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
        _mm512_storeu_ps(y + i, _mm512_div_ps(_mm512_mul_ps(gv, _mm512_loadu_ps(u + i)), den));
    }
#endif
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)));
        _mm256_storeu_ps(y + i, _mm256_div_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(u + i)), den));
    }
    for (; i < n; i++) y[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* gpt-oss's gate: y = g * sigmoid(alpha g) * (u + 1), g clamped above at limit and u to
   [-limit, limit] */
static void clamped_swiglu(const float *g, const float *u, float *y, int n, float alpha, float limit) {
    for (int i = 0; i < n; i++) {
        const float gi = fminf(g[i], limit), ui = fminf(fmaxf(u[i], -limit), limit);
        y[i] = gi / (1.f + expf(-alpha * gi)) * (ui + 1.f);
    }
}

/* tanh(x) = 1 - 2 / (e^2x + 1), eight at a time (exp8 saturates, so |x| large gives +-1) */
static inline __m256 tanh8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.f);
    const __m256 e = exp8(_mm256_add_ps(x, x));
    return _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
}

/* y = gelu_tanh(g) * u (Gemma's gate): gelu(x) = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
static void gelu_glu(const float *g, const float *u, float *y, int n) {
    const __m256 c = _mm256_set1_ps(0.7978845608028654f), a = _mm256_set1_ps(0.044715f);
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f);
    int i = 0;
#ifdef __AVX512F__                      /* sixteen at a time where the CPU has them: the same bits */
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                           _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), _mm512_mul_ps(x, x), x));
        const __m512 ge = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(_mm512_set1_ps(1.f), tanh16(inner)));
        _mm512_storeu_ps(y + i, _mm512_mul_ps(ge, _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 inner = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(a, x), _mm256_mul_ps(x, x), x));
        const __m256 ge = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh8(inner)));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(ge, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) {
        const float x = g[i];
        y[i] = 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x))) * u[i];
    }
}

/* x -> cap * tanh(x / cap) over n values (soft-capping) */
static void softcap(float *x, int n, float cap) {
    const __m256 cv = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.f / cap);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(cv, tanh8(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv))));
    for (; i < n; i++) x[i] = cap * tanhf(x[i] / cap);
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

#include "gguf_blocks.h"

/* Where a step's time goes, for benchmarks/step_phases.py: built with -DSTEP_PHASES, thread 0
   reads the clock after each op (after its barrier, so an op's time includes waiting for the
   slower thread) and adds it to the op's total; otherwise compiled out. */
enum { PH_EMBED, PH_NORM, PH_QKV, PH_ROPE_STORE, PH_ATTENTION, PH_ROUND, PH_O, PH_RESIDUAL, PH_GATE_UP,
       PH_GLU, PH_DOWN, PH_EXPERTS, PH_HEAD, PH_COUNT };
#ifdef STEP_PHASES
static double phase_s[PH_COUNT], phase_at;
static long phase_steps;
#define PHASE(i) do { if (omp_get_thread_num() == 0) { const double t_ = omp_get_wtime(); \
                       phase_s[i] += t_ - phase_at; phase_at = t_; } } while (0)
/* the totals so far (seconds an op, PH_COUNT of them) and the steps they cover */
long step_phases(double *out) { memcpy(out, phase_s, sizeof phase_s); return phase_steps; }
#else
#define PHASE(i) do {} while (0)
#endif

static qact row_of(qact a, int r, int k) {
    const qact out = { a.q + (size_t)r * groups_of(k) * ACT_GROUP, a.xo + (size_t)r * OUT_MAX };
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
    if (nb < nbp) {         /* the short group: zeros after its blocks (its vectors read past them) */
        int8_t *g = a.q + (size_t)(nb / GB) * ACT_GROUP;
        memset(g + nb % GB * QK, 0, (size_t)(GB - nb % GB) * QK);
        for (int f = XD; f <= XU; f += GB) memset((float *)g + f + nb % GB, 0, sizeof(float) * (GB - nb % GB));
    }
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
        const float d = _mm_cvtss_f32(m) / 127.f, id = d >= FLT_MIN ? 1.f / d : 0.f, fsum = hsum8(sum);
        __m256i qsum;
        int8_t *group = a.q + (size_t)(b / GB) * ACT_GROUP;
        if (b >= nb / GB * GB) {
            codes_32(v, id, group + (b % GB) * QK, &qsum);      /* the short group: in order */
        } else {
            int8_t codes[QK];
            codes_32(v, id, codes, &qsum);
            for (int i = 0; i < 8; i++) memcpy(group + (b % GB) * 4 + 64 * i, codes + 4 * i, 4);   /* lane b % 16 */
        }
        const int isum = hsum8i(qsum);
        float *f = (float *)group + b % GB;
        f[XD] = d;
        f[XS] = fsum;
        f[XE] = fsum - d * (float)isum;
        ((int32_t *)f)[XU] = isum;
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
    } else if (m == 2) {
        const __m128 old = _mm_castpd_ps(_mm_load_sd((const double *)dst));
        _mm_store_sd((double *)dst, _mm_castps_pd(accumulate ? _mm_add_ps(old, v) : v));
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

/* ---- the vectors the tiles work in: LANES 32-bit lanes, one block each. With AVX-512 VNNI a
   zmm holds a whole group (16 lanes, the group's 64-byte vectors as they are); else a ymm holds
   half of it (8 lanes, the group's two halves in turn, the 32 bytes at 64k + 32h of vector k).
   The layout is the same on both paths; the per-lane sums, so the results, are not. ---- */
#if WIDE
typedef __m512 vf;
typedef __m512i vi;
#define vf_zero _mm512_setzero_ps
#define vi_zero _mm512_setzero_si512
#define vf_load _mm512_loadu_ps
#define vi_load(p) _mm512_loadu_si512((const void *)(p))
#define vf_fmadd _mm512_fmadd_ps
#define vf_mul _mm512_mul_ps
#define vf_of _mm512_cvtepi32_ps
#define vi_and _mm512_and_si512
#define vi_srl4(v) _mm512_srli_epi16((v), 4)
#define vi_set1_8 _mm512_set1_epi8
#define VDOT(acc, q, v) _mm512_dpbusd_epi32((acc), (q), (v))
#define VHDOT VDOT
#define VHFIX(acc, sum) _mm512_sub_epi32((acc), _mm512_slli_epi32((sum), 7))
INLINE vf vf_h16(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE vf vf_u8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
/* lanes l and l + 8 added: the eight lanes the outliers and the final sum take */
INLINE __m256 vf_fold(vf v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
/* a short group's 16 per-block floats (scales) in registers, and a vector of its blocks b and
   b + 1 (two to a vector: b's in lanes 0-7, b + 1's in lanes 8-15) */
typedef __m512 v16;
INLINE v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
INLINE vf v16_part(v16 v, int h) { (void)h; return v; }
INLINE vf v16_pair(v16 v, int b) {
    const __m512i two = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(b), two), v);
}
/* n > 1: blocks b, b+1 of a short group's Q4 codes (16 bytes each) as [b's low nibbles | high |
   b+1's low | high]; n == 1: b's alone, the rest zero (not read: it may be past the row) */
INLINE vi tail_codes_q4(const uint8_t *c, int n) {
    const __m512i two = _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(n > 1 ? 0xFFFFFFFFu : 0xFFFFu, c));
    const __m512i dup = _mm512_shuffle_i64x2(two, two, _MM_SHUFFLE(1, 1, 0, 0));
    return _mm512_and_si512(_mm512_mask_srli_epi16(dup, 0xFF00FF00u, dup, 4), _mm512_set1_epi8(0x0F));
}
INLINE vi tail_codes_q8(const uint8_t *c, int n) { return _mm512_maskz_loadu_epi8(n > 1 ? ~0ull : 0xFFFFFFFFull, c); }
/* a short group's first n fp16 fields (scales, minima) / bytes (zero points) as floats, the
   lanes past n zero: masked loads, never past the row */
INLINE vf short_h16(const uint8_t *p, int n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p)); }
INLINE vf short_u8(const uint8_t *p, int n) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1), p)));
}
/* signed codes q against the activations: |q| against v with q's sign (AVX-512 has no vpsignb;
   v is never -128) */
INLINE vi sdot(vi q, vi v) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(q),
                               _mm512_mask_sub_epi8(v, _mm512_movepi8_mask(q), _mm512_setzero_si512(), v));
}
#else
typedef __m256 vf;
typedef __m256i vi;
#define vf_zero _mm256_setzero_ps
#define vi_zero _mm256_setzero_si256
#define vf_load _mm256_loadu_ps
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vf_fmadd _mm256_fmadd_ps
#define vf_mul _mm256_mul_ps
#define vf_of _mm256_cvtepi32_ps
#define vi_and _mm256_and_si256
#define vi_srl4(v) _mm256_srli_epi16((v), 4)
#define vi_set1_8 _mm256_set1_epi8
#define VDOT DPBUSD
#define VHDOT HDOT
#define VHFIX HFIX
INLINE vf vf_h16(const void *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE vf vf_u8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
INLINE __m256 vf_fold(vf v) { return v; }
/* a short group's blocks go one to a vector */
typedef struct { __m256 h[2]; } v16;
INLINE v16 v16_load(const float *p) { const v16 v = {{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}}; return v; }
INLINE vf v16_part(v16 v, int h) { return v.h[h]; }
INLINE vf v16_pair(v16 v, int b) { return _mm256_permutevar8x32_ps(v.h[b / 8], _mm256_set1_epi32(b % 8)); }
INLINE vi tail_codes_q4(const uint8_t *c, int n) {
    (void)n;
    const __m128i b = _mm_loadu_si128((const __m128i *)c);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}
INLINE vi tail_codes_q8(const uint8_t *c, int n) { (void)n; return _mm256_loadu_si256((const __m256i *)c); }
INLINE __m256i lanes_below(int t) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(t), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/* a short group's first n (of 8, or more) fp16 fields / bytes as floats, the lanes past n zero:
   the loads take whole 4-byte words (vpmaskmovd), never past the row */
INLINE vf short_h16(const uint8_t *p, int n) {
    n = n < 8 ? n : 8;
    const __m128i raw = _mm_maskload_epi32((const int *)p, _mm256_castsi256_si128(lanes_below((n + 1) / 2)));
    return _mm256_and_ps(_mm256_cvtph_ps(raw), _mm256_castsi256_ps(lanes_below(n)));
}
INLINE vf short_u8(const uint8_t *p, int n) {
    n = n < 8 ? n : 8;
    const __m128i raw = _mm_maskload_epi32((const int *)p, _mm256_castsi256_si128(lanes_below((n + 3) / 4)));
    return _mm256_and_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw)), _mm256_castsi256_ps(lanes_below(n)));
}
INLINE vi sdot(vi q, vi v) { return DPBUSD(_mm256_setzero_si256(), _mm256_sign_epi8(q, q), _mm256_sign_epi8(v, q)); }
#endif
#define HALVES (GB / LANES)     /* vectors a group takes */

/* a short group's t fp16 scales as floats, zeros after them */
INLINE v16 v16_h16(const uint8_t *p, int t) {
    v16 v;
#if WIDE
    v = short_h16(p, t);
#else
    v.h[0] = short_h16(p, t);
    v.h[1] = short_h16(p + 16, t - 8);
#endif
    return v;
}
#define PER_VEC (LANES / 8)     /* blocks of a short group a vector takes */

/* part h of group g (blocks b0 = 16g + LANES*h on, lane l block b0 + l) of the weight rows
   w[0..M) against the activation rows x[0..N), into acc[i][j]'s lanes. Per (i, j) the same
   operations whatever M and N, so a row's result does not depend on its tile: the blocks' exact
   integer dots, then acc += idot * (dw * dx), += m * s, += z*dw * e */
INLINE void group_q4(const q4row *w, const int M, const qact *x, const int N, const int g, const int h,
                     vf acc[4][4]) {
    const vi lo = vi_set1_8(0x0F);
    const int b0 = GB * g + LANES * h;
    vf dv[4], mv[4], zd[4];
    vi iacc[4][4];
    #pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        dv[i] = vf_h16(w[i].d + 2 * b0);
        mv[i] = vf_h16(w[i].m + 2 * b0);
        zd[i] = vf_mul(vf_u8(w[i].z + b0), dv[i]);
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) iacc[i][j] = vi_zero();
    }
    #pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        vi ql[4], qh[4];
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const vi P = vi_load(w[i].c + 256 * g + 64 * k + 32 * h);
            ql[i] = vi_and(P, lo);
            qh[i] = vi_and(vi_srl4(P), lo);
        }
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const int8_t *v = x[j].q + ACT_GROUP * g + 32 * h;
            const vi vl = vi_load(v + 64 * k), vh = vi_load(v + 64 * (k + 4));
            #pragma GCC unroll 4
            for (int i = 0; i < M; i++) {
                iacc[i][j] = VDOT(iacc[i][j], ql[i], vl);
                iacc[i][j] = VDOT(iacc[i][j], qh[i], vh);
            }
        }
    }
    #pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        const float *f = act_f(&x[j], g, LANES * h);
        const vf dx = vf_load(f + XD), s = vf_load(f + XS), e = vf_load(f + XE);
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            vf a = vf_fmadd(vf_of(iacc[i][j]), vf_mul(dv[i], dx), acc[i][j]);
            a = vf_fmadd(mv[i], s, a);
            acc[i][j] = vf_fmadd(zd[i], e, a);
        }
    }
}

/* the row's last t = nb % 16 blocks (G: their group), each in its GGUF order (16 code bytes,
   low nibbles elements 0-15, high 16-31; the activations' 32 codes in order), PER_VEC blocks a
   vector: a block's integer dot is left as eight lanes of partial sums, scaled by its (dw * dx)
   and added into acc[i][j]'s lanes (a missing second block: zeros); then the minimum's and zero
   point's terms of the t blocks, part by part as in group_q4 (lanes past t: zeros) */
INLINE void tail_q4(const q4row *w, const int M, const qact *x, const int N, const int G, const int t,
                    vf acc[4][4]) {
    v16 dw[4];
    #pragma GCC unroll 4
    for (int i = 0; i < M; i++) dw[i] = v16_h16(w[i].d + 2 * GB * G, t);
    for (int b = 0; b < t; b += PER_VEC) {
        vi q[4];
        vf dwb[4];
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            q[i] = tail_codes_q4(w[i].c + 256 * G + 16 * b, t - b);
            dwb[i] = v16_pair(dw[i], b);
        }
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const vi v = vi_load(x[j].q + ACT_GROUP * G + 32 * b);
            const vf dx = v16_pair(v16_load(act_f(&x[j], G, XD)), b);
            #pragma GCC unroll 4
            for (int i = 0; i < M; i++)
                acc[i][j] = vf_fmadd(vf_of(VDOT(vi_zero(), q[i], v)), vf_mul(dwb[i], dx), acc[i][j]);
        }
    }
    for (int h = 0; h < (t + LANES - 1) / LANES; h++) {
        const int b0 = GB * G + LANES * h;
        vf mv[4], zd[4];
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            mv[i] = short_h16(w[i].m + 2 * b0, t - LANES * h);
            zd[i] = vf_mul(short_u8(w[i].z + b0, t - LANES * h), v16_part(dw[i], h));
        }
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const vf s = vf_load(act_f(&x[j], G, XS + LANES * h)), e = vf_load(act_f(&x[j], G, XE + LANES * h));
            #pragma GCC unroll 4
            for (int i = 0; i < M; i++) acc[i][j] = vf_fmadd(zd[i], e, vf_fmadd(mv[i], s, acc[i][j]));
        }
    }
}

/* y[r0 + j][n0 + i] (+)= W[n0 + i] . x[r0 + j], i < M, j < N */
INLINE void tile_q4(const proj_q4 *p, int n0, const int M, qact a, int r0, const int N, float *y,
                    int ystride, int accumulate) {
    const int nb = p->k / QK, G = nb / GB, t = nb % GB;
    q4row w[4];
    qact x[4];
    vf acc[4][4];
    #pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        w[i] = q4_row(p, n0 + i);
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) acc[i][j] = vf_zero();
    }
    #pragma GCC unroll 4
    for (int j = 0; j < N; j++) x[j] = row_of(a, r0 + j, p->k);
    for (int g = 0; g < G; g++) {
        #pragma GCC unroll 2
        for (int h = 0; h < HALVES; h++) group_q4(w, M, x, N, g, h, acc);
    }
    if (t) tail_q4(w, M, x, N, G, t, acc);
    #pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        __m256 v[4];
        float rest[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            v[i] = i < M ? outliers(p, n0 + i, &x[j], vf_fold(acc[i][j]), rest + i) : _mm256_setzero_ps();
        /* the rests gathered lane by lane: one 16-byte load of four 4-byte stores would wait on them */
        put_m(y + (size_t)(r0 + j) * ystride + n0,
              _mm_add_ps(hsum4x8(v[0], v[1], v[2], v[3]), _mm_setr_ps(rest[0], rest[1], rest[2], rest[3])), M, accumulate);
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
INLINE void group_q8(const q8row *w, const int M, const qact *x, const int N, const int g, const int h,
                     vf acc[4][4]) {
    const int b0 = GB * g + LANES * h;
    vf dv[4];
    vi iacc[4][4];
    #pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        dv[i] = vf_h16(w[i].d + 2 * b0);
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) iacc[i][j] = vi_zero();
    }
    #pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        vi q[4];
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++) q[i] = vi_load(w[i].c + 512 * g + 64 * k + 32 * h);
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const vi v = vi_load(x[j].q + ACT_GROUP * g + 64 * k + 32 * h);
            #pragma GCC unroll 4
            for (int i = 0; i < M; i++) iacc[i][j] = VHDOT(iacc[i][j], q[i], v);
        }
    }
    #pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        const vf dx = vf_load(act_f(&x[j], g, XD + LANES * h));
        const vi sum = vi_load(act_f(&x[j], g, XU + LANES * h));
        (void)sum;
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++)
            acc[i][j] = vf_fmadd(vf_of(VHFIX(iacc[i][j], sum)), vf_mul(dv[i], dx), acc[i][j]);
    }
}

/* the head's tail_q4: the last t blocks' codes signed, in order, PER_VEC blocks a vector, each
   block's dot as eight lanes of partial sums scaled by its (dw * dx) */
INLINE void tail_q8(const q8row *w, const int M, const qact *x, const int N, const int G, const int t,
                    vf acc[4][4]) {
    v16 dw[4];
    #pragma GCC unroll 4
    for (int i = 0; i < M; i++) dw[i] = v16_h16(w[i].d + 2 * GB * G, t);
    for (int b = 0; b < t; b += PER_VEC) {
        vi q[4];
        vf dwb[4];
        #pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            q[i] = tail_codes_q8(w[i].c + 512 * G + 32 * b, t - b);
            dwb[i] = v16_pair(dw[i], b);
        }
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) {
            const vi v = vi_load(x[j].q + ACT_GROUP * G + 32 * b);
            const vf dx = v16_pair(v16_load(act_f(&x[j], G, XD)), b);
            #pragma GCC unroll 4
            for (int i = 0; i < M; i++)
                acc[i][j] = vf_fmadd(vf_of(sdot(q[i], v)), vf_mul(dwb[i], dx), acc[i][j]);
        }
    }
}

INLINE void tile_q8(const proj_q8 *p, int n0, const int M, qact a, int r0, const int N, float *y) {
    const int nb = p->k / QK, G = nb / GB, t = nb % GB;
    q8row w[4];
    qact x[4];
    vf acc[4][4];
    #pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        w[i] = q8_row(p, n0 + i);
        #pragma GCC unroll 4
        for (int j = 0; j < N; j++) acc[i][j] = vf_zero();
    }
    #pragma GCC unroll 4
    for (int j = 0; j < N; j++) x[j] = row_of(a, r0 + j, p->k);
    for (int g = 0; g < G; g++) {
        #pragma GCC unroll 2
        for (int h = 0; h < HALVES; h++) group_q8(w, M, x, N, g, h, acc);
    }
    if (t) tail_q8(w, M, x, N, G, t, acc);
    #pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        __m256 v[4];
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++) v[i] = i < M ? vf_fold(acc[i][j]) : _mm256_setzero_ps();
        put_m(y + (size_t)(r0 + j) * p->n + n0, hsum4x8(v[0], v[1], v[2], v[3]), M, 0);
    }
}

/* each weight-tile height its own function: the tiles of four activation rows in [r0, r1), then
   one of the last one to three, the loops above unrolled for each (one call a weight tile: the
   set-up is shared, and a tile's float tail overlaps the next one's dots) */
typedef void (*tiles_q4_fn)(const proj_q4 *, int, qact, int, int, float *, int, int);
typedef void (*tiles_q8_fn)(const proj_q8 *, int, qact, int, int, float *);
#define TILES(M)                                                                                  \
    static void tiles_q4_##M(const proj_q4 *p, int n, qact a, int r0, int r1, float *y, int ys, int ac) { \
        int r = r0;                                                                               \
        for (; r + 4 <= r1; r += 4) tile_q4(p, n, M, a, r, 4, y, ys, ac);                         \
        if (r1 - r == 3) tile_q4(p, n, M, a, r, 3, y, ys, ac);                                    \
        else if (r1 - r == 2) tile_q4(p, n, M, a, r, 2, y, ys, ac);                               \
        else if (r1 - r == 1) tile_q4(p, n, M, a, r, 1, y, ys, ac);                               \
    }                                                                                             \
    static void tiles_q8_##M(const proj_q8 *p, int n, qact a, int r0, int r1, float *y) {         \
        int r = r0;                                                                               \
        for (; r + 4 <= r1; r += 4) tile_q8(p, n, M, a, r, 4, y);                                 \
        if (r1 - r == 3) tile_q8(p, n, M, a, r, 3, y);                                            \
        else if (r1 - r == 2) tile_q8(p, n, M, a, r, 2, y);                                       \
        else if (r1 - r == 1) tile_q8(p, n, M, a, r, 1, y);                                       \
    }
TILES(1)
TILES(2)
TILES(3)
TILES(4)
static const tiles_q4_fn TILES_Q4[4] = {tiles_q4_1, tiles_q4_2, tiles_q4_3, tiles_q4_4};
static const tiles_q8_fn TILES_Q8[4] = {tiles_q8_1, tiles_q8_2, tiles_q8_3, tiles_q8_4};

/* weight rows a tile takes: 4 while few activation rows share each weight load, else 2 (two
   rows of weights by four of activations keep their accumulators in registers) */
static inline int tile_rows(int rows) { return rows < 4 ? 4 : 2; }

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

/* y[r][n] (+)= W[n] . x[r] for every row r: tiles of weight rows split across threads, each
   meeting the activation rows four at a time */
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
            TILES_Q4[m - 1](p, n0, a, r0, r1, y, ystride, accumulate);
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
        TILES_Q8[m - 1](p, n0, a, 0, rows, y);
    }
}

/* ---- the scalar reference: the same arithmetic one lane and one element at a time, from the
   layout's definition, with the path's LANES (tests check the tiles against it bit for bit) ---- */

static float f16_at(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

/* in a row of nb blocks: element e's code of block b (q4: 4-bit; q8: stored byte) and the
   activation's; whole groups by lanes (vector e/4 of the group, lane b % 16), the short last
   group's blocks in order */
static int short_block(int nb, int b) { return b >= nb / GB * GB; }

static int q4_code(const uint8_t *c, int nb, int b, int e) {
    const size_t g = b / GB, j = b % GB;
    const int byte = e % 16;
    const uint8_t v = short_block(nb, b) ? c[g * 256 + 16 * j + byte] : c[g * 256 + 64 * (byte / 4) + 4 * j + byte % 4];
    return e < 16 ? v & 15 : v >> 4;
}

static int q8_code(const uint8_t *c, int nb, int b, int e) {
    const size_t g = b / GB, j = b % GB;
    return short_block(nb, b) ? (int8_t)c[g * 512 + 32 * j + e] : (int)c[g * 512 + 64 * (e / 4) + 4 * j + e % 4] - 128;
}

static int act_code(const qact *x, int nb, int b, int e) {
    const size_t g = b / GB, j = b % GB;
    return short_block(nb, b) ? x->q[g * ACT_GROUP + 32 * j + e] : x->q[g * ACT_GROUP + 64 * (e / 4) + 4 * j + e % 4];
}

/* the LANES lanes folded to 8 (vf_fold), then summed as hsum4x8 does */
static void fold_ref(const float *acc, float *v8) {
    for (int l = 0; l < 8; l++) v8[l] = LANES == 16 ? acc[l] + acc[l + 8] : acc[l];
}

static float hsum8_ref(const float *v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

/* the integer dot of block b, whole or as eight lanes of four elements' partial sums */
static int block_dot(const uint8_t *c, int q8, int nb, int b, const qact *x, int lane) {
    int sum = 0;
    for (int e = lane < 0 ? 0 : 4 * lane; e < (lane < 0 ? QK : 4 * lane + 4); e++)
        sum += (q8 ? q8_code(c, nb, b, e) : q4_code(c, nb, b, e)) * act_code(x, nb, b, e);
    return sum;
}

/* the short group's dots: PER_VEC blocks a vector, lane l block b0 + l / 8's partial sum l % 8
   (a missing block: 0 at scale 0) */
static void short_dots_ref(const uint8_t *c, const uint8_t *d, int q8, int nb, const qact *x, float *acc) {
    for (int b0 = nb / GB * GB; b0 < nb; b0 += PER_VEC)
        for (int l = 0; l < LANES; l++) {
            const int b = b0 + l / 8;
            const float dot = b < nb ? (float)block_dot(c, q8, nb, b, x, l % 8) : 0.f;
            acc[l] = fmaf(dot, b < nb ? f16_at(d + 2 * b) * act_f(x, b / GB, XD)[b % GB] : 0.f, acc[l]);
        }
}

static float ref_q4(const proj_q4 *p, int n, const qact *x) {
    const int nb = p->k / QK, G = nb / GB, t = nb % GB;
    const q4row w = q4_row(p, n);
    float acc[LANES] = {0}, v[8];
    for (int b = 0; b < GB * G; b++) {          /* whole groups: block b in lane b % LANES, in order */
        const float d = f16_at(w.d + 2 * b), zd = (float)w.z[b] * d;
        float *a = acc + b % LANES;
        *a = fmaf((float)block_dot(w.c, 0, nb, b, x, -1), d * act_f(x, b / GB, XD)[b % GB], *a);
        *a = fmaf(f16_at(w.m + 2 * b), act_f(x, b / GB, XS)[b % GB], *a);
        *a = fmaf(zd, act_f(x, b / GB, XE)[b % GB], *a);
    }
    if (t) {
        short_dots_ref(w.c, w.d, 0, nb, x, acc);
        for (int b = GB * G; b < GB * G + (t + LANES - 1) / LANES * LANES; b++) {   /* lanes past t: zeros */
            float d = 0.f, m = 0.f, zd = 0.f;
            if (b < nb) {
                d = f16_at(w.d + 2 * b);
                m = f16_at(w.m + 2 * b);
                zd = (float)w.z[b] * d;
            }
            float *a = acc + b % LANES;
            *a = fmaf(m, act_f(x, b / GB, XS)[b % GB], *a);
            *a = fmaf(zd, act_f(x, b / GB, XE)[b % GB], *a);
        }
    }
    fold_ref(acc, v);
    const float *ow = p->out_w + (size_t)n * p->n_out;
    int j = 0;
    for (; j + 8 <= p->n_out; j += 8)
        for (int l = 0; l < 8; l++) v[l] = fmaf(ow[j + l], x->xo[j + l], v[l]);
    float rest = 0.f;
    for (; j < p->n_out; j++) rest += ow[j] * x->xo[j];
    return hsum8_ref(v) + rest;
}

static float ref_q8(const proj_q8 *p, int n, const qact *x) {
    const int nb = p->k / QK, G = nb / GB;
    const q8row w = q8_row(p, n);
    float acc[LANES] = {0}, v[8];
    for (int b = 0; b < GB * G; b++)
        acc[b % LANES] = fmaf((float)block_dot(w.c, 1, nb, b, x, -1), f16_at(w.d + 2 * b) * act_f(x, b / GB, XD)[b % GB], acc[b % LANES]);
    short_dots_ref(w.c, w.d, 1, nb, x, acc);
    fold_ref(acc, v);
    return hsum8_ref(v);
}

/* floats of the activations' part of the scratch: the q4 layout's or, from the same start,
   the stored formats' (gact_layout), whichever is larger */
static long act_floats(int rows, int k) {
    const long q4 = (long)rows * ((long)groups_of(k) * ACT_GROUP / (long)sizeof(float) + OUT_MAX);
    return q4 > gact_floats(rows, k) ? q4 : gact_floats(rows, k);
}

/* the activations' part of the scratch: rows of width up to k in the q4 layout; returns its
   end, past the stored formats' layouts of those rows too (the router's matmul reads them
   while the experts' scratch after them is written) */
static float *act_layout(float *at, int rows, int k, qact *a) {
    a->q = (int8_t *)at;
    a->xo = at + (size_t)rows * groups_of(k) * ACT_GROUP / sizeof(float);
    return at + act_floats(rows, k);
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

/* a row's cosines and sines at position pos for one table of frequencies (rot / 2 of each) */
static void rope_angles(float *cs, int rot, const float *inv_freq, int64_t pos) {
    for (int i = 0; i < rot / 2; i++) {
        const float f = (float)pos * inv_freq[i];
        cs[i] = cosf(f);
        cs[rot / 2 + i] = sinf(f);
    }
}

/* each layer's table of RoPE frequencies among the distinct ones (the layers of one base share
   theirs, so a row's cosines and sines are computed once a table, not once a layer: at 128
   pairs a head, they were 6% of a prefill): slot[l], the first layer of each table rep[t], and
   how many tables */
static int rope_tables(const model_t *m, int *slot, int *rep) {
    const int half = m->rot_dim / 2;
    int n = 0;
    for (int l = 0; l < m->layers; l++) {
        slot[l] = -1;
        for (int t = 0; t < n && slot[l] < 0; t++)
            if (!memcmp(m->inv_freq + (size_t)l * half, m->inv_freq + (size_t)rep[t] * half, sizeof(float) * half))
                slot[l] = t;
        if (slot[l] < 0) { rep[n] = l; slot[l] = n++; }
    }
    return n;
}

/* rotate_half RoPE of `heads` heads of v, on the first rot of each head's hd dimensions (the
   rest pass: partial rotary), by the row's cosines and sines cs (rope_angles) */
static void rope(float *v, int heads, int hd, int rot, const float *cs) {
    const int half = rot / 2;
    const float *c = cs, *s = cs + half;
    for (int h = 0; h < heads; h++) {          /* a head's pairs in a row: the loop vectorises */
        float *lo = v + (size_t)h * hd, *hi = lo + half;
        for (int i = 0; i < half; i++) {
            const float a = lo[i], b = hi[i];
            lo[i] = a * c[i] - b * s[i];
            hi[i] = b * c[i] + a * s[i];
        }
    }
}

static inline void add_bias(float *y, const float *b, int n) { if (b) axpy(y, 1.f, b, n); }

/* K/V formats of the pool (cache.dtype; twophase/kv_formats.py): a row is one head's vector of
   hd values as stored: float32, float16, bfloat16, or q8_0 (hd int8 codes, then a float16 scale
   a run of 32 values) */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8 = 3 };

static inline size_t row_bytes(int type, int hd) {
    return type == KV_F32 ? 4 * (size_t)hd : type == KV_Q8 ? (size_t)hd + 2 * (hd / QK) : 2 * (size_t)hd;
}

/* where layer l keeps its K/V: its slot in the pool, its group's block tables and slots, its window */
typedef struct { int slot; const int64_t *tables, *slots; int window; } lay_t;

static inline lay_t layer_of(const model_t *m, const step_t *s, int l) {
    const int g = m->group ? m->group[l] : 0;
    const lay_t out = { m->slot ? m->slot[l] : l, s->tables + (size_t)g * s->seqs * s->width,
                        s->slots + (size_t)g * s->rows, m->window ? m->window[l] : 0 };
    return out;
}

/* the first key row r attends to: its window's, or 0 */
static inline int first_key(const lay_t *ly, const step_t *s, int r) {
    return ly->window && s->ctx[r] > ly->window ? s->ctx[r] - ly->window : 0;
}

static inline uint8_t *pool_block(const step_t *s, const model_t *m, int slot, int kv, int64_t block, int head) {
    const size_t i = (((size_t)slot * 2 + kv) * s->num_blocks + block) * m->kv_heads + head;
    return (uint8_t *)s->pool + i * s->block_size * row_bytes(s->kv_type, m->head_dim);
}

/* a row of `type` decoded into hd floats (exactly: a q8_0 value is its code times its run's
   float16 scale, a product float32 holds without rounding) */
INLINE void decode_as(const uint8_t *row, float *f, int hd, const int type) {
    int i = 0;
    if (type == KV_Q8)                  /* a run at a time, its scale read once */
        for (; i + QK <= hd; i += QK) {
            uint16_t d;
            memcpy(&d, row + hd + 2 * (i / QK), 2);
#ifdef __AVX512F__
            const __m512 sv = _mm512_set1_ps(h2f(d));
            for (int j = 0; j < QK; j += 16)
                _mm512_storeu_ps(f + i + j, _mm512_mul_ps(sv, _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i + j))))));
#else
            const __m256 sv = _mm256_set1_ps(h2f(d));
            for (int j = 0; j < QK; j += 8)
                _mm256_storeu_ps(f + i + j, _mm256_mul_ps(sv, _mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i + j))))));
#endif
        }
    for (; i + 8 <= hd; i += 8) {
        __m256 v;
        if (type == KV_F16) {
            v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
        } else if (type == KV_BF16) {
            v = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i))), 16));
        } else {
            v = _mm256_loadu_ps((const float *)row + i);
        }
        _mm256_storeu_ps(f + i, v);
    }
    for (; i < hd; i++) {
        uint16_t h;
        if (type == KV_F32) { memcpy(f + i, row + 4 * (size_t)i, 4); continue; }
        memcpy(&h, row + 2 * (size_t)i, 2);
        if (type == KV_F16) { f[i] = h2f(h); continue; }
        const uint32_t u = (uint32_t)h << 16;
        memcpy(f + i, &u, 4);
    }
}

/* x (hd floats) as a row of `type`: q8_0 as ggml's quantize_row_q8_0_ref (the scale amax / 127
   in float32, codes rounded half away from zero, the scale kept in float16); bfloat16 rounded to
   nearest even, as torch rounds */
static void store_row(uint8_t *row, const float *x, int hd, int type) {
    if (type == KV_F32) { memcpy(row, x, sizeof(float) * hd); return; }
    if (type == KV_Q8) {
        for (int b = 0; b < hd / QK; b++) {
            float amax = 0.f;
            for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[b * QK + j]));
            const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
            for (int j = 0; j < QK; j++) ((int8_t *)row)[b * QK + j] = (int8_t)roundf(x[b * QK + j] * id);
            const uint16_t h = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
            memcpy(row + hd + 2 * b, &h, 2);
        }
        return;
    }
    for (int i = 0; i < hd; i++) {
        uint16_t h;
        if (type == KV_F16) {
            h = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
        } else {
            uint32_t u;
            memcpy(&u, x + i, 4);
            h = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);    /* NaN-free values here */
        }
        memcpy(row + 2 * (size_t)i, &h, 2);
    }
}

/* Attention reads each K/V row once for all G query heads that share it (GQA), as float32: a
   float32 pool's rows in place, any other format's decoded once into a tile. A row's keys are
   cut into parts of part_len keys (a fixed length, so a row's output depends on its context alone, never
   on its batch or the threads): each part gives per head its unnormalised sum of values with its
   own maximum score and sum of weights, and the parts are combined in order (flash-decoding's
   split), so a single long sequence spreads over all the threads. */
#ifndef TILE_BYTES
#define TILE_BYTES 16384
#endif

/* keys a part takes: as many float32 rows as fill a tile that stays in a core's L1 beside the
   scores (the rows are read once per query head of the group), at least 16 */
static inline int part_len(const model_t *m) {
    const int n = TILE_BYTES / (4 * m->head_dim) / 8 * 8;
    return n < 16 ? 16 : n;
}

static inline int parts_of(const model_t *m, int n) { return (n + part_len(m) - 1) / part_len(m); }

/* floats a part's result takes for one query head: hd sums, then the maximum score and the sum
   of weights */
static inline int part_floats(const model_t *m) { return m->head_dim + 2; }

/* blocks of K/V a thread asks for ahead of the row it decodes: the rows stream from memory once
   a step, a block's 16 rows of a head apart from its next block's, and the hardware's
   prefetcher alone left the decode waiting on each block (2,048 tokens of context, float16:
   rows came in at about 5 GB/s a thread) */
#ifndef BLOCKS_AHEAD
#define BLOCKS_AHEAD 8
#endif

/* the rows of keys [b, e) of row r's sequence, a layer's K or V (kv) for head kh, decoded into
   tile (a float32 row copied: one way for every format, the copy a small cost beside the read) */
INLINE void rows_as(const model_t *m, const step_t *s, int slot, int kv, const int64_t *table, int kh,
                    int r, int b, int e, float *tile, const int type) {
    const int hd = m->head_dim, BS = s->block_size, nb = (s->ctx[r] + BS - 1) / BS;
    const size_t rb = row_bytes(type, hd);
    for (int j = 0; j < BLOCKS_AHEAD && b / BS + j < nb; j++) {
        const uint8_t *ahead = pool_block(s, m, slot, kv, table[b / BS + j], kh);
        for (size_t i = 0; i < BS * rb; i += 64) _mm_prefetch((const char *)ahead + i, _MM_HINT_T0);
    }
    for (int t0 = b; t0 < e; t0 = (t0 / BS + 1) * BS) {      /* a block (or the part of it in [b, e)) */
        if (t0 / BS + BLOCKS_AHEAD < nb) {
            const uint8_t *ahead = pool_block(s, m, slot, kv, table[t0 / BS + BLOCKS_AHEAD], kh);
            for (size_t i = 0; i < BS * rb; i += 64) _mm_prefetch((const char *)ahead + i, _MM_HINT_T0);
        }
        const uint8_t *blk = pool_block(s, m, slot, kv, table[t0 / BS], kh);
        const int end = (t0 / BS + 1) * BS < e ? (t0 / BS + 1) * BS : e;
        for (int t = t0, u = t0 % BS; t < end; t++, u++)
            decode_as(blk + (size_t)u * rb, tile + (size_t)(t - b) * hd, hd, type);
    }
}

static void rows_float(const model_t *m, const step_t *s, int slot, int kv, const int64_t *table, int kh,
                       int r, int b, int e, float *tile) {
    switch (s->kv_type) {
    case KV_F16: rows_as(m, s, slot, kv, table, kh, r, b, e, tile, KV_F16); break;
    case KV_BF16: rows_as(m, s, slot, kv, table, kh, r, b, e, tile, KV_BF16); break;
    case KV_Q8: rows_as(m, s, slot, kv, table, kh, r, b, e, tile, KV_Q8); break;
    default: rows_as(m, s, slot, kv, table, kh, r, b, e, tile, KV_F32);
    }
}

/* q . k for four keys: per key the same operations in the same order whatever the other three
   are, so a key's score does not depend on the keys beside it */
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
    for (; i < hd; i++)
        r = _mm_add_ps(r, _mm_mul_ps(_mm_set1_ps(q[i]), _mm_setr_ps(k0[i], k1[i], k2[i], k3[i])));
    return r;
}

/* scores (n of them) into softmax weights e^(s - max), unnormalised; their maximum and sum into
   stat[0] and stat[1] */
static void weigh(float *sc, int n, float *stat) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 best = _mm256_set1_ps(-INFINITY), total = _mm256_setzero_ps();
    for (int t = 0; t < n; t += 8) {
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - t), iota);
        best = _mm256_max_ps(best, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(sc + t, keep),
                                                    _mm256_castsi256_ps(keep)));
    }
    __m128 b4 = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
    b4 = _mm_max_ps(b4, _mm_movehl_ps(b4, b4));
    b4 = _mm_max_ss(b4, _mm_movehdup_ps(b4));
    const __m256 bv = _mm256_set1_ps(_mm_cvtss_f32(b4));
    for (int t = 0; t < n; t += 8) {
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - t), iota);
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(sc + t, keep), bv)),
                                       _mm256_castsi256_ps(keep));
        _mm256_maskstore_ps(sc + t, keep, e);
        total = _mm256_add_ps(total, e);
    }
    stat[0] = _mm_cvtss_f32(b4);
    stat[1] = hsum8(total);
}

/* out (hd) = sum over the n rows of tile of w[u] * row u: 64 of the output's elements held in
   registers over all the rows, then eight at a time */
static void weighted_sum(const float *w, const float *tile, int n, int hd, float *out) {
    int c = 0;
    for (; c + 64 <= hd; c += 64) {
        __m256 acc[8];
        #pragma GCC unroll 8
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int u = 0; u < n; u++) {
            const __m256 pv = _mm256_broadcast_ss(w + u);
            #pragma GCC unroll 8
            for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(tile + (size_t)u * hd + c + 8 * i), acc[i]);
        }
        #pragma GCC unroll 8
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + c + 8 * i, acc[i]);
    }
    for (; c + 8 <= hd; c += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int u = 0; u < n; u++) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(w + u), _mm256_loadu_ps(tile + (size_t)u * hd + c), acc);
        _mm256_storeu_ps(out + c, acc);
    }
    for (; c < hd; c++) {
        float o = 0.f;
        for (int u = 0; u < n; u++) o += w[u] * tile[(size_t)u * hd + c];
        out[c] = o;
    }
}

/* the G query heads' (q: hd apart) scores against the n keys at kt, weighed (softmax's
   unnormalised weights into sc, G * part_len floats; each head's maximum and sum into res) */
static void part_scores(const model_t *m, const float *q, const float *kt, int n, float *sc, float *res) {
    const int hd = m->head_dim, G = m->heads / m->kv_heads, PF = part_floats(m), P = part_len(m);
    const __m128 scale = _mm_set1_ps(m->scale);
    #define K(u) (kt + (size_t)(u) * hd)
    for (int g = 0; g < G; g++) {
        const float *qg = q + (size_t)g * hd;
        float *sg = sc + (size_t)g * P;
        int u = 0;
        for (; u + 4 <= n; u += 4)
            _mm_storeu_ps(sg + u, _mm_mul_ps(dot4(qg, K(u), K(u + 1), K(u + 2), K(u + 3), hd), scale));
        for (; u < n; u++)
            sg[u] = _mm_cvtss_f32(_mm_mul_ps(dot4(qg, K(u), K(u), K(u), K(u), hd), scale));
        if (m->attn_cap) softcap(sg, n, m->attn_cap);
        weigh(sg, n, res + (size_t)g * PF + hd);
    }
    #undef K
}

/* the G heads' weighted sums of the n values at vt into res */
static void part_values(const model_t *m, const float *sc, const float *vt, int n, float *res) {
    const int G = m->heads / m->kv_heads, PF = part_floats(m), P = part_len(m);
    for (int g = 0; g < G; g++) weighted_sum(sc + (size_t)g * P, vt, n, m->head_dim, res + (size_t)g * PF);
}

/* part p of row r's keys (from its window's first on) for the G query heads of K/V head kh (q:
   their vectors, hd apart) into res (G results of part_floats); sc: G * part_len floats, tile:
   part_len * hd */
static void attend_part(const model_t *m, const step_t *s, const lay_t *ly, int r, int kh, int p,
                        const float *q, float *res, float *sc, float *tile) {
    const int P = part_len(m), b = first_key(ly, s, r) + p * P, e = s->ctx[r] < b + P ? s->ctx[r] : b + P;
    const int64_t *table = ly->tables + (size_t)s->seq[r] * s->width;
    rows_float(m, s, ly->slot, 0, table, kh, r, b, e, tile);
    part_scores(m, q, tile, e - b, sc, res);
    rows_float(m, s, ly->slot, 1, table, kh, r, b, e, tile);
    part_values(m, sc, tile, e - b, res);
}

/* Rows [a, z) of one sequence's prompt chunk (consecutive positions) for K/V head kh: each
   part's keys decoded once for all of them (the union of their parts p: at most part_len + z -
   a - 1 keys, their windows' starts a key apart), each row's part then computed from its own
   keys in the tile exactly as attend_part does, so the results are attend_part's bit for bit.
   q(r): row r's query heads; res + (r - a) * rstride: its parts' results; sc: (z - a) * G *
   part_len floats; tile: (part_len + ATTN_ROWS) * hd. */
static void attend_rows(const model_t *m, const step_t *s, const lay_t *ly, int a, int z, int kh,
                        const float *wide, int W, float *res, size_t rstride, float *sc, float *tile) {
    const int hd = m->head_dim, G = m->heads / m->kv_heads, P = part_len(m), PF = part_floats(m);
    const int64_t *table = ly->tables + (size_t)s->seq[a] * s->width;
    int np = 0;
    for (int r = a; r < z; r++) {
        const int n = parts_of(m, s->ctx[r] - first_key(ly, s, r));
        np = n > np ? n : np;
    }
    for (int p = 0; p < np; p++) {
        int lo = -1, hi = 0;
        for (int r = a; r < z; r++) {
            const int b = first_key(ly, s, r) + p * P;
            if (b >= s->ctx[r]) continue;
            const int e = s->ctx[r] < b + P ? s->ctx[r] : b + P;
            lo = lo < 0 || b < lo ? b : lo;
            hi = e > hi ? e : hi;
        }
        if (lo < 0) continue;
        for (int kv = 0; kv < 2; kv++) {
            rows_float(m, s, ly->slot, kv, table, kh, z - 1, lo, hi, tile);
            for (int r = a; r < z; r++) {
                const int b = first_key(ly, s, r) + p * P;
                if (b >= s->ctx[r]) continue;
                const int e = s->ctx[r] < b + P ? s->ctx[r] : b + P;
                float *rr = res + (size_t)(r - a) * rstride + (size_t)p * G * PF, *sr = sc + (size_t)(r - a) * G * P;
                const float *t = tile + (size_t)(b - lo) * hd;
                if (kv == 0) part_scores(m, wide + (size_t)r * W + (size_t)kh * G * hd, t, e - b, sr, rr);
                else part_values(m, sr, t, e - b, rr);
            }
        }
    }
}

/* the np parts' results (in order) into the G heads' outputs (hd apart); sink: the G heads'
   sink logits (NULL: none), each one more term in its softmax's denominator */
static void combine(const model_t *m, const float *res, int np, float *out, const float *sink) {
    const int hd = m->head_dim, G = m->heads / m->kv_heads, PF = part_floats(m);
    for (int g = 0; g < G; g++) {
        float best = sink ? sink[g] : -INFINITY, total = sink ? 1.f : 0.f;
        for (int p = 0; p < np; p++) best = fmaxf(best, res[((size_t)p * G + g) * PF + hd]);
        if (sink) total = expf(sink[g] - best);
        float *o = out + (size_t)g * hd;
        for (int c = 0; c < hd; c++) o[c] = 0.f;
        for (int p = 0; p < np; p++) {
            const float *rp = res + ((size_t)p * G + g) * PF;
            const float w = expf(rp[hd] - best);
            total += w * rp[hd + 1];
            for (int c = 0; c < hd; c++) o[c] += w * rp[c];
        }
        const float inv = 1.f / total;
        for (int c = 0; c < hd; c++) o[c] *= inv;
    }
}

#include "amx_attention.h"

/* whether a step's parts are tasks of their own: when its (row, K/V head) pairs are too few to
   keep the threads busy (the results then go through memory shared by the threads) */
static inline int split_parts(const model_t *m, int rows, int threads) {
    return rows * m->kv_heads < 4 * threads;
}

/* rows of one prompt chunk a thread's attention takes together (attend_rows), where their
   parts' results fit in ATTN_ROWS_FLOATS */
#define ATTN_ROWS 8
#define ATTN_ROWS_FLOATS (1L << 20)
static inline int attn_rows(const model_t *m, int max_ctx) {
    const long one = (long)parts_of(m, max_ctx) * (m->heads / m->kv_heads) * part_floats(m);
    const long n = ATTN_ROWS_FLOATS / (one > 0 ? one : 1);
    return n < 1 ? 1 : n > ATTN_ROWS ? ATTN_ROWS : (int)n;
}

/* floats of scratch a thread's attention takes: the vector path's scores, tile and its parts'
   results (each for attn_rows rows) */
static long vector_thread_floats(const model_t *m, int max_ctx) {
    const int G = m->heads / m->kv_heads, AR = attn_rows(m, max_ctx);
    return (long)AR * G * part_len(m) + (long)(part_len(m) + ATTN_ROWS) * m->head_dim
         + (long)AR * parts_of(m, max_ctx) * G * part_floats(m);
}

/* ... and the tiles' tasks' after it */
static long attn_thread_floats(const model_t *m, int max_ctx) {
    return vector_thread_floats(m, max_ctx) + amx_attn_floats(m);
}

/* floats the threads share for a step's attention parts (when split_parts) */
static long attn_parts_floats(const model_t *m, int rows, int max_ctx, int threads) {
    return split_parts(m, rows, threads)
        ? (long)rows * m->kv_heads * parts_of(m, max_ctx) * (m->heads / m->kv_heads) * part_floats(m) : 0;
}

/* every row's attention for layer l: q of row r at wide + r * W, its output at attn + r * QD
   (QD = heads * head_dim) */
static void attention(const model_t *m, const step_t *s, int layer, const float *wide, int W, float *attn,
                      float *mine, float *shared) {
    const int R = s->rows, KVH = m->kv_heads, hd = m->head_dim, QD = m->heads * hd, G = m->heads / KVH;
    const int NP = parts_of(m, s->max_ctx), PF = part_floats(m);
    const lay_t ly = layer_of(m, s, layer);
    const int AR = attn_rows(m, s->max_ctx);
    float *sc = mine, *tile = sc + (size_t)AR * G * part_len(m), *res = tile + (size_t)(part_len(m) + ATTN_ROWS) * hd;
    /* long prompt chunks on the tiles first (amx_attention.h), the other rows meanwhile */
    const int tiles = amx_attends(m, s);
    int32_t *blk = (int32_t *)(shared + attn_parts_floats(m, R, s->max_ctx, s->threads));
    if (tiles) {
        #pragma omp single
        amx_mark_tasks(m, s, blk);
        amx_attention(m, s, &ly, layer, wide, W, attn, blk, mine + vector_thread_floats(m, s->max_ctx));
    }
    #define VECTOR(r) (!tiles || blk[r] == 0)
    #define Q_OF(r, kh) (wide + (size_t)(r) * W + (size_t)(kh) * G * hd)
    #define OUT_OF(r, kh) (attn + (size_t)(r) * QD + (size_t)(kh) * G * hd)
    #define PARTS(r) parts_of(m, s->ctx[r] - first_key(&ly, s, r))
    #define SINK(kh) (m->sinks ? m->sinks + (size_t)layer * m->heads + (size_t)(kh) * G : NULL)
    if (split_parts(m, R, s->threads)) {
        #pragma omp for schedule(dynamic)
        for (int i = 0; i < R * KVH * NP; i++) {
            const int r = i / (KVH * NP), kh = i / NP % KVH, p = i % NP;
            if (p < PARTS(r) && VECTOR(r))
                attend_part(m, s, &ly, r, kh, p, Q_OF(r, kh), shared + (size_t)i * G * PF, sc, tile);
        }
        #pragma omp for
        for (int i = 0; i < R * KVH; i++)
            if (VECTOR(i / KVH))
                combine(m, shared + (size_t)i * NP * G * PF, PARTS(i / KVH), OUT_OF(i / KVH, i % KVH), SINK(i % KVH));
    } else {
        /* blocks of AR rows; within one, each run of a sequence's consecutive rows together */
        const int NB = (R + AR - 1) / AR;
        #pragma omp for schedule(dynamic)
        for (int i = 0; i < NB * KVH; i++) {
            const int r0 = i / KVH * AR, r1 = r0 + AR < R ? r0 + AR : R, kh = i % KVH;
            for (int a = r0, z; a < r1; a = z) {
                if (!VECTOR(a)) { z = a + 1; continue; }
                for (z = a + 1; z < r1 && s->seq[z] == s->seq[a] && s->ctx[z] == s->ctx[z - 1] + 1; z++) {}
                attend_rows(m, s, &ly, a, z, kh, wide, W, res, (size_t)NP * G * PF, sc, tile);
                for (int r = a; r < z; r++)
                    combine(m, res + (size_t)(r - a) * NP * G * PF, PARTS(r), OUT_OF(r, kh), SINK(kh));
            }
        }
    }
    #undef VECTOR
    #undef Q_OF
    #undef OUT_OF
    #undef PARTS
    #undef SINK
}

/* row r (x, k wide) rounded for the projection p: into a (q4), or g (the stored formats) */
static void round_row(const model_t *m, const float *x, int k, const proj_q4 *p, qact a, const gact *g, int r) {
    if (m->stored) gquantize_row(g, r);
    else quantize_row(x, k, p ? p->out_idx : NULL, p ? p->n_out : 0, row_of(a, r, k));
}

/* y (+)= the projection of the step's rows: q4 p through its tiles, or the stored sp */
static void project(const model_t *m, const proj_q4 *p, const proj_g *sp, int rows, qact a, const gact *g,
                    float *y, int ystride, int accumulate, next_t next) {
    if (m->stored) matmul_g(sp, rows, g, y, ystride, accumulate, 1);
    else matmul_q4(p, rows, a, y, ystride, accumulate, next);
}

/* each row of x normed into h and rounded for the projection p (rows split across threads) */
static void norm_rows(const model_t *m, const float *x, const float *gamma, float *h, int rows,
                      const proj_q4 *p, qact a, const gact *g) {
    const int D = m->dim;
    #pragma omp for
    for (int r = 0; r < rows; r++) {
        rmsnorm(x + (size_t)r * D, gamma, h + (size_t)r * D, D, m->eps);
        round_row(m, h + (size_t)r * D, D, p, a, g, r);
    }
}

static int widest(const model_t *m) {
    const int q = (m->heads + 2 * m->kv_heads) * m->head_dim;
    return 2 * m->ffn > q ? 2 * m->ffn : q;
}

static inline int max3(int a, int b, int c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* the widest row a projection rounds: the hidden size, the MLP's width, or the heads' outputs */
static int act_width(const model_t *m) { return max3(m->dim, m->ffn, m->heads * m->head_dim); }

/* The experts' scratch for a step of `rows` tokens: each token's routes (expert, weight; its
   rows routed, top_k a token, gathered by expert so each expert's rows read once for them all),
   the router's scores, and the gathered rows' h, activations (of h, then of the MLP), gate and
   up, MLP output and down output. */
typedef struct {
    float *score, *weight, *h, *wide, *mlp, *out, *act;
    int32_t *expert, *pos, *src, *first;     /* [rows * top_k] x3; [experts + 1] */
} moe_t;

static long moe_floats(const model_t *m, int rows) {
    if (!m->experts) return 0;
    const long n = (long)rows * m->top_k, D = m->dim, F = m->ffn;
    return rows * (long)m->experts + 4 * n + m->experts + 1 + n * (D + 2 * F + F + D)
         + act_floats(n, D > F ? D : F);
}

static moe_t moe_layout(const model_t *m, float *at, int rows) {
    const long n = (long)rows * m->top_k, D = m->dim, F = m->ffn;
    moe_t e;
    e.score = at; e.weight = e.score + (long)rows * m->experts;
    e.expert = (int32_t *)(e.weight + n); e.pos = e.expert + n; e.src = e.pos + n; e.first = e.src + n;
    e.h = (float *)(e.first + m->experts + 1); e.wide = e.h + n * D; e.mlp = e.wide + n * 2 * F;
    e.out = e.mlp + n * F; e.act = e.out + n * D;
    return e;
}

/* floats the threads share for a step's attention: its parts' results, then each row's task on
   the tiles (amx_mark_tasks) */
static long attn_shared_floats(const model_t *m, int rows, int max_ctx, int threads) {
    return attn_parts_floats(m, rows, max_ctx, threads) + rows;
}

/* the instruction set this build's kernels run: 0 AVX2 (no VNNI), 1 AVX-VNNI (256-bit), 2 AVX-512 VNNI */
int kernel_isa(void) {
#if WIDE
    return 2;
#elif defined(__AVXVNNI__)
    return 1;
#else
    return 0;
#endif
}

/* floats of the rows' cosines and sines, a table of frequencies each (rope_tables) */
static long rope_floats(const model_t *m, int rows) {
    int slot[m->layers], rep[m->layers];
    return (long)rope_tables(m, slot, rep) * rows * m->rot_dim;
}

/* floats of scratch a step of `rows` tokens attending to at most `max_ctx` needs */
long step_scratch_floats(const model_t *m, int rows, int max_ctx, int threads) {
    const long D = m->dim, F = m->ffn, QD = (long)m->heads * m->head_dim;
    return rows * (2 * D + QD + widest(m) + F)         /* x, h, attn, wide, mlp */
         + act_floats(rows, act_width(m))              /* int8 codes; d, s, e, sums; outliers */
         + (long)threads * attn_thread_floats(m, max_ctx) + attn_shared_floats(m, rows, max_ctx, threads)
         + moe_floats(m, rows) + rope_floats(m, rows);
}

/* the gathered rows from `off` on, as an activation block of their own */
static gact gact_from(const gact *a, int off) {
    gact v = *a;
    v.x += (size_t)off * a->xstride;
    v.q += (size_t)off * a->k;
    v.d += (size_t)off * (a->k / 32);
    v.s += (size_t)off * (a->k / 16);
    v.ds += (size_t)off * (a->k / 32);
    v.pq += (size_t)off * a->k;
    v.ls += (size_t)off * (a->k / 32) * 4;
    if (off % TR) v.tq = NULL;                  /* not on a group: the rows one at a time */
    else if (v.tq) { v.tq += (size_t)off * 32; v.td += off; v.tds += off; v.tls += (size_t)off * 4; }
    v.rows -= off;
    v.xb += off;                                /* a column of the tiles' layout */
    return v;
}

/* the gate: y = act(g) * u over F values */
static void glu(const model_t *m, float *g, float *u, float *y, int F) {
    if (m->act == ACT_GELU_TANH) gelu_glu(g, u, y, F);
    else if (m->act == ACT_CLAMPED) clamped_swiglu(g, u, y, F, m->glu_alpha, m->glu_limit);
    else swiglu(g, u, y, F);
}

static void into_residual(const model_t *m, float *x, float *y, const float *b, const float *post, int rows);

/* layer l's experts on the normed rows h (rounded in gh): each row's top_k of the router's
   softmax (renormalised if the family does), the rows gathered by expert, each routed expert's
   projections over its rows only (experts no row chose are not read), and each row's weighted
   sum of its experts' outputs, in its routes' order, into the residual x (or y, post-normed) */
static void moe_mlp(const model_t *m, int l, int R, const float *h, const gact *gh, moe_t e,
                    float *x, float *y, const float *post) {
    const int D = m->dim, F = m->ffn, E = m->experts, K = m->top_k, n = R * K;
    matmul_g(m->s_router + l, R, gh, e.score, E, 0, 1);
    #pragma omp for
    for (int r = 0; r < R; r++) {                        /* softmax, then the top k */
        float *p = e.score + (size_t)r * E, mx, sum = 0.f, kept = 0.f;
        if (m->router_bias) add_bias(p, m->router_bias + (size_t)l * E, E);
        mx = p[0];
        for (int i = 1; i < E; i++) mx = fmaxf(mx, p[i]);
        for (int i = 0; i < E; i++) sum += (p[i] = expf(p[i] - mx));
        for (int j = 0; j < K; j++) {
            int best = -1;
            for (int i = 0; i < E; i++) {
                int taken = 0;
                for (int t = 0; t < j; t++) taken |= e.expert[r * K + t] == i;
                if (!taken && (best < 0 || p[i] > p[best])) best = i;
            }
            e.expert[r * K + j] = best;
            e.weight[r * K + j] = p[best] / sum;
            kept += p[best] / sum;
        }
        if (m->norm_topk)
            for (int j = 0; j < K; j++) e.weight[r * K + j] /= kept;
    }
    #pragma omp single
    {                               /* the routes gathered by expert (a counting sort, stable) */
        for (int i = 0; i <= E; i++) e.first[i] = 0;
        for (int j = 0; j < n; j++) e.first[e.expert[j] + 1]++;
        for (int i = 0; i < E; i++) e.first[i + 1] += e.first[i];
        for (int j = 0; j < n; j++) {                     /* first[i] runs on to expert i's end */
            e.pos[j] = e.first[e.expert[j]]++;
            e.src[e.pos[j]] = j / K;
        }
        for (int i = E; i > 0; i--) e.first[i] = e.first[i - 1];
        e.first[0] = 0;
    }
    /* an expert with as many routed rows as the step's threshold takes the tiles (gh->amx) */
    const gact ga = gact_tiles(gact_layout(e.act, n, D, e.h, D), gh->amx);
    #pragma omp for
    for (int j = 0; j < n; j++) {
        memcpy(e.h + (size_t)j * D, h + (size_t)e.src[j] * D, sizeof(float) * D);
        gquantize_row(&ga, j);
    }
    for (int i = 0; i < E; i++) {
        const int rows = e.first[i + 1] - e.first[i];
        if (!rows) continue;
        const gact v = gact_from(&ga, e.first[i]);
        matmul_g(m->s_exp_gu + (size_t)l * E + i, rows, &v, e.wide + (size_t)e.first[i] * 2 * F, 2 * F, 0, 1);
    }
    if (m->exp_gu_bias) {                                /* each route's expert's biases */
        #pragma omp for
        for (int j = 0; j < n; j++)
            add_bias(e.wide + (size_t)e.pos[j] * 2 * F, m->exp_gu_bias + ((size_t)l * E + e.expert[j]) * 2 * F, 2 * F);
    }
    const gact gm = gact_tiles(gact_layout(e.act, n, F, e.mlp, F), gh->amx);
    #pragma omp for
    for (int j = 0; j < n; j++) {
        float *g = e.wide + (size_t)j * 2 * F;
        glu(m, g, g + F, e.mlp + (size_t)j * F, F);
        gquantize_row(&gm, j);
    }
    for (int i = 0; i < E; i++) {
        const int rows = e.first[i + 1] - e.first[i];
        if (!rows) continue;
        const gact v = gact_from(&gm, e.first[i]);
        matmul_g(m->s_exp_dn + (size_t)l * E + i, rows, &v, e.out + (size_t)e.first[i] * D, D, 0, 1);
    }
    if (m->exp_dn_bias) {
        #pragma omp for
        for (int j = 0; j < n; j++)
            add_bias(e.out + (size_t)e.pos[j] * D, m->exp_dn_bias + ((size_t)l * E + e.expert[j]) * D, D);
    }
    #pragma omp for
    for (int r = 0; r < R; r++) {
        float *to = post ? y + (size_t)r * D : x + (size_t)r * D;
        if (post) memset(to, 0, sizeof(float) * D);
        for (int j = 0; j < K; j++)
            axpy(to, e.weight[r * K + j], e.out + (size_t)e.pos[r * K + j] * D, D);
    }
    if (post) into_residual(m, x, y, NULL, post, R);
}

/* a projection's output y (n wide, ystride apart; NULL-safe bias b) into the residual x: added
   (the projection accumulated into x itself), or normed first where the family norms it (post) */
static void into_residual(const model_t *m, float *x, float *y, const float *b, const float *post, int rows) {
    const int D = m->dim;
    #pragma omp for
    for (int r = 0; r < rows; r++) {
        float *xr = x + (size_t)r * D, *yr = y + (size_t)r * D;
        if (!post) { add_bias(xr, b, D); continue; }
        add_bias(yr, b, D);
        rmsnorm(yr, post, yr, D, m->eps);
        axpy(xr, 1.f, yr, D);
    }
}

/* row r's q, k and v (v: the projection's output): biases, QK-norm, RoPE (cs: the row's
   cosines and sines for layer l's table) */
static void qkv_row(const model_t *m, int l, float *v, const float *cs) {
    const int H = m->heads, KVH = m->kv_heads, hd = m->head_dim;
    if (m->qkv_bias) add_bias(v, m->qkv_bias + (size_t)l * (H + 2 * KVH) * hd, (H + 2 * KVH) * hd);
    if (m->q_norm)
        for (int h = 0; h < H + KVH; h++) {
            const float *g = h < H ? m->q_norm + (size_t)l * hd : m->k_norm + (size_t)l * hd;
            rmsnorm(v + (size_t)h * hd, g, v + (size_t)h * hd, hd, m->eps);
        }
    rope(v, H + KVH, hd, m->rot_dim, cs);
}

void step(const model_t *m, const step_t *s) {
    const int R = s->rows, D = m->dim, H = m->heads, KVH = m->kv_heads, hd = m->head_dim, QD = H * hd;
    const int F = m->ffn, W = widest(m), A = act_width(m), st = m->stored;
    float *x = s->scratch, *h = x + (size_t)R * D, *attn = h + (size_t)R * D;
    float *wide = attn + (size_t)R * QD, *mlp = wide + (size_t)R * W;
    qact a;
    float *per_thread = act_layout(mlp + (size_t)R * F, R, A, &a);
    /* the stored formats' rounded activations, in the same scratch: of h, attn and mlp */
    const gact gh = gact_tiles(gact_layout((float *)a.q, R, D, h, D), s->amx);
    const gact gat = gact_tiles(gact_layout((float *)a.q, R, QD, attn, QD), s->amx);
    const gact gmlp = gact_tiles(gact_layout((float *)a.q, R, F, mlp, F), s->amx);
    float *after_attn = per_thread + (size_t)s->threads * attn_thread_floats(m, s->max_ctx)
                        + attn_shared_floats(m, R, s->max_ctx, s->threads);
    const moe_t moe = moe_layout(m, after_attn, R);
    int slot[m->layers], rep[m->layers];
    const int tables = rope_tables(m, slot, rep), rot = m->rot_dim;
    float *angles = after_attn + moe_floats(m, R);       /* [tables][R][rot]: rope_angles' */

#ifdef STEP_PHASES
    phase_steps++;
    phase_at = omp_get_wtime();
#endif
    #pragma omp parallel num_threads(s->team)
    {
        float *mine = per_thread + (size_t)omp_get_thread_num() * attn_thread_floats(m, s->max_ctx);
        float *shared = per_thread + (size_t)s->threads * attn_thread_floats(m, s->max_ctx);
        #pragma omp for
        for (int r = 0; r < R; r++) {
            float *xr = x + (size_t)r * D;
            memcpy(xr, m->embed + (size_t)s->tokens[r] * D, sizeof(float) * D);
            if (m->embed_scale != 1.f)
                for (int i = 0; i < D; i++) xr[i] *= m->embed_scale;
            for (int t = 0; t < tables; t++)
                rope_angles(angles + ((size_t)t * R + r) * rot, rot, m->inv_freq + (size_t)rep[t] * (rot / 2), s->positions[r]);
        }
        PHASE(PH_EMBED);

        for (int l = 0; l < m->layers; l++) {
            const proj_q4 *qkv = st ? NULL : m->qkv + l, *o = st ? NULL : m->o + l;
            const proj_q4 *gu = st ? NULL : m->gate_up + l, *dn = st ? NULL : m->down + l;
            const proj_g *sqkv = st ? m->s_qkv + l : NULL, *so = st ? m->s_o + l : NULL;
            const proj_g *sgu = st ? m->s_gate_up + l : NULL, *sdn = st ? m->s_down + l : NULL;
            const float *pa = m->post_attn_norm ? m->post_attn_norm + (size_t)l * D : NULL;
            const float *pm = m->post_mlp_norm ? m->post_mlp_norm + (size_t)l * D : NULL;
            const float *ob = m->o_bias ? m->o_bias + (size_t)l * D : NULL;
            const float *db = m->down_bias ? m->down_bias + (size_t)l * D : NULL;
            const lay_t ly = layer_of(m, s, l);
            const next_t none = {0};
            norm_rows(m, x, m->attn_norm + (size_t)l * D, h, R, qkv, a, &gh);
            PHASE(PH_NORM);
            project(m, qkv, sqkv, R, a, &gh, wide, W, 0, st ? none : next_q4(o));
            PHASE(PH_QKV);
            #pragma omp for
            for (int r = 0; r < R; r++) {          /* biases, QK-norm, RoPE; the token's K/V into the pool */
                float *v = wide + (size_t)r * W;
                qkv_row(m, l, v, angles + ((size_t)slot[l] * R + r) * rot);
                const int64_t blk = ly.slots[r] / s->block_size;
                const int off = (int)(ly.slots[r] % s->block_size);
                const size_t rb = row_bytes(s->kv_type, hd);
                for (int kh = 0; kh < KVH; kh++) {
                    store_row(pool_block(s, m, ly.slot, 0, blk, kh) + off * rb, v + (H + kh) * hd, hd, s->kv_type);
                    store_row(pool_block(s, m, ly.slot, 1, blk, kh) + off * rb, v + (H + KVH + kh) * hd, hd, s->kv_type);
                }
            }
            PHASE(PH_ROPE_STORE);
            attention(m, s, l, wide, W, attn, mine, shared);
            PHASE(PH_ATTENTION);
            #pragma omp for
            for (int r = 0; r < R; r++) round_row(m, attn + (size_t)r * QD, QD, o, a, &gat, r);
            PHASE(PH_ROUND);
            project(m, o, so, R, a, &gat, pa ? h : x, D, !pa, st ? none : next_q4(gu));
            PHASE(PH_O);
            if (pa || ob) into_residual(m, x, h, ob, pa, R);
            PHASE(PH_RESIDUAL);
            norm_rows(m, x, m->mlp_norm + (size_t)l * D, h, R, gu, a, &gh);
            PHASE(PH_NORM);
            if (m->experts) {
                moe_mlp(m, l, R, h, &gh, moe, x, wide, pm);
                PHASE(PH_EXPERTS);
                continue;
            }
            project(m, gu, sgu, R, a, &gh, wide, W, 0, st ? none : next_q4(dn));
            PHASE(PH_GATE_UP);
            #pragma omp for
            for (int r = 0; r < R; r++) {
                float *g = wide + (size_t)r * W;
                float *y = mlp + (size_t)r * F;
                add_bias(g, m->gate_up_bias ? m->gate_up_bias + (size_t)l * 2 * F : NULL, 2 * F);
                glu(m, g, g + F, y, F);
                round_row(m, y, F, dn, a, &gmlp, r);
            }
            PHASE(PH_GLU);
            project(m, dn, sdn, R, a, &gmlp, pm ? h : x, D, !pm,
                    st ? none : l + 1 < m->layers ? next_q4(m->qkv + l + 1) : next_q8(&m->head));
            PHASE(PH_DOWN);
            if (pm || db) into_residual(m, x, h, db, pm, R);
            PHASE(PH_RESIDUAL);
        }
        #pragma omp for
        for (int i = 0; i < s->n_logits; i++) {
            rmsnorm(x + (size_t)s->logit_rows[i] * D, m->final_norm, h + (size_t)i * D, D, m->eps);
            round_row(m, h + (size_t)i * D, D, NULL, a, &gh, i);
        }
        if (st) matmul_g(m->s_head, s->n_logits, &gh, s->logits, m->vocab, 0, 1);
        else matmul_q8(&m->head, s->n_logits, a, s->logits);
        if (m->final_cap) {
            #pragma omp for
            for (int i = 0; i < s->n_logits; i++) softcap(s->logits + (size_t)i * m->vocab, m->vocab, m->final_cap);
        }
        PHASE(PH_HEAD);
    }
}


/* For tests: y = W x for `rows` rows of x ([rows][k] float32) of a projection in stored formats,
   through the vector path (on `threads` threads) into fast and the scalar one into ref ([rows][n]
   each), and the rounded activations d * q into xq ([rows][k]); scratch: act_floats(rows, k) */
void check_matmul_stored(const proj_g *p, int rows, const float *x, float *fast, float *ref, float *xq,
                         float *scratch, int threads) {
    const gact g = gact_layout(scratch, rows, p->k, x, p->k);
    for (int r = 0; r < rows; r++) gquantize_row(&g, r);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < p->k; i++) xq[(size_t)r * p->k + i] = g.d[(size_t)r * (p->k / 32) + i / 32] * g.q[(size_t)r * p->k + i];
    #pragma omp parallel num_threads(threads)
    {
        matmul_g(p, rows, &g, fast, p->n, 0, 1);
        matmul_g(p, rows, &g, ref, p->n, 0, 0);
    }
}

/* For benchmarks: y = W x ([rows][n]) as a step runs a projection on the int8 paths: the rows
   rounded, then the vector path's dots on `threads` threads; scratch: act_floats(rows, k) */
void run_matmul_stored(const proj_g *p, int rows, const float *x, float *y, float *scratch, int threads) {
    const gact g = gact_layout(scratch, rows, p->k, x, p->k);
    for (int r = 0; r < rows; r++) gquantize_row(&g, r);
    #pragma omp parallel num_threads(threads)
    matmul_g(p, rows, &g, y, p->n, 0, 1);
}

/* For benchmarks and tests: y = W x ([rows][n]) on the tiles whatever the rows and types (a
   step gives float rows and small steps the other paths), the rows rounded as a step rounds
   them, on `threads` threads; returns amx_request()'s answer (y untouched unless 1); scratch:
   act_floats(rows, k) */
int run_matmul_amx(const proj_g *p, int rows, const float *x, float *y, float *scratch, int threads) {
    const int ok = amx_request();
    if (ok != 1) return ok;
#if HAVE_AMX
    gact g = gact_layout(scratch, rows, p->k, x, p->k);
    g.amx = 1;
    for (int r = 0; r < rows; r++) gquantize_row(&g, r);
    #pragma omp parallel num_threads(threads)
    matmul_amx(p, rows, &g, y, p->n, 0);
#else
    (void)p; (void)rows; (void)x; (void)y; (void)scratch; (void)threads;
#endif
    return ok;
}

/* f rounded to the nearest bfloat16, ties to even (finite f) */
static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* For tests: y = W x for `rows` rows of x through the AMX tiles into fast ([rows][n]), and the
   reference on the same bf16 values into ref: each weight decoded a run at a time from the
   layout's definition (sub_terms, codes_ref), both sides rounded to bf16 (to nearest even), the
   products summed in double (run_matmul_amx's rows and types). Returns amx_request()'s answer;
   fast is untouched unless 1. */
int check_matmul_amx(const proj_g *p, int rows, const float *x, float *fast, float *ref, float *scratch, int threads) {
    const int K = p->k;
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < p->n; n++) {
            int t, left;
            const uint8_t *w = weight_row(p, n, &t, &left);
            double acc = 0.;
            for (int i = 0; i < K; i++) {
                float v;
                if (is_float_type(t)) v = float_at(t, w, i);
                else {
                    const int runs = type_values(t) / 32, g = i / 32;
                    const uint8_t *b = w + (size_t)(g / runs) * type_bytes(t);
                    const sub_t st = sub_terms(t, b, g % runs);
                    uint8_t u[32];
                    codes_ref(t, b, g % runs, u);
                    const int code = signed_codes(t) ? (int)(int8_t)u[i % 32] : (int)u[i % 32] - st.o;
                    v = fmaf(st.s[i % 32 / 16], (float)code, st.bias);
                }
                acc += (double)bf16_round(v) * (double)bf16_round(x[(size_t)r * K + i]);
            }
            ref[(size_t)r * p->n + n] = (float)acc;
        }
    return run_matmul_amx(p, rows, x, fast, scratch, threads);
}

/* For tests: the model's GLU (m->act) of n gates g and values u into y, as a step computes it */
void check_glu(const model_t *m, float *g, float *u, float *y, int n) { glu(m, g, u, y, n); }

/* For tests: layer 0's attention alone, for the step's rows (q: [rows][heads * head_dim], out:
   [rows][heads * head_dim]), on s->threads threads; s->scratch: step_scratch_floats */
void check_attention(const model_t *m, const step_t *s, const float *q, float *out) {
    float *per_thread = s->scratch;
    #pragma omp parallel num_threads(s->threads)
    {
        float *mine = per_thread + (size_t)omp_get_thread_num() * attn_thread_floats(m, s->max_ctx);
        float *shared = per_thread + (size_t)s->threads * attn_thread_floats(m, s->max_ctx);
        attention(m, s, 0, q, m->heads * m->head_dim, out, mine, shared);
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

/* The structs kernel.py passes, as this compiler laid them out: kernel.py declares each once (a
   table of names and ctypes types) and checks that declaration against these at load, so a field
   added, dropped or moved on one side only stops the load naming it, not a step reading the
   wrong bytes. A struct's table ends with its size. */
typedef struct { const char *name; size_t offset, size; } field_t;
#define FIELD(T, f) {#f, offsetof(T, f), sizeof(((T *)0)->f)}
#define END(T) {NULL, sizeof(T), 0}
#define M(f) FIELD(model_t, f)
static const field_t model_fields[] = {
    M(layers), M(dim), M(heads), M(kv_heads), M(head_dim), M(ffn), M(vocab), M(eps), M(embed), M(attn_norm),
    M(mlp_norm), M(final_norm), M(inv_freq), M(qkv), M(o), M(gate_up), M(down), M(head), M(stored), M(s_qkv),
    M(s_o), M(s_gate_up), M(s_down), M(s_head), M(rot_dim), M(scale), M(embed_scale), M(attn_cap),
    M(final_cap), M(act), M(q_norm), M(k_norm), M(post_attn_norm), M(post_mlp_norm), M(qkv_bias), M(o_bias),
    M(gate_up_bias), M(down_bias), M(window), M(slot), M(group), M(experts), M(top_k), M(norm_topk),
    M(s_router), M(s_exp_gu), M(s_exp_dn), M(sinks), M(router_bias), M(exp_gu_bias), M(exp_dn_bias),
    M(glu_alpha), M(glu_limit), END(model_t)};
#define S(f) FIELD(step_t, f)
static const field_t step_fields[] = {
    S(rows), S(tokens), S(positions), S(slots), S(tables), S(width), S(seqs), S(seq), S(ctx), S(n_logits),
    S(logit_rows), S(pool), S(num_blocks), S(block_size), S(kv_type), S(logits), S(scratch), S(max_ctx),
    S(threads), S(team), S(amx), END(step_t)};
static const field_t proj_q4_fields[] = {
    FIELD(proj_q4, n), FIELD(proj_q4, k), FIELD(proj_q4, n_out), FIELD(proj_q4, w), FIELD(proj_q4, out_idx),
    FIELD(proj_q4, out_w), END(proj_q4)};
static const field_t proj_q8_fields[] = {FIELD(proj_q8, n), FIELD(proj_q8, k), FIELD(proj_q8, w), END(proj_q8)};
static const field_t part_fields[] = {FIELD(part_t, type), FIELD(part_t, n), FIELD(part_t, w), END(part_t)};
static const field_t proj_g_fields[] = {
    FIELD(proj_g, n), FIELD(proj_g, k), FIELD(proj_g, parts), FIELD(proj_g, part), END(proj_g)};
static const struct { const char *type; const field_t *fields; } layouts[] = {
    {"model_t", model_fields}, {"step_t", step_fields}, {"proj_q4", proj_q4_fields},
    {"proj_q8", proj_q8_fields}, {"part_t", part_fields}, {"proj_g", proj_g_fields}};

static const field_t *fields_of(const char *type) {
    for (size_t t = 0; t < sizeof(layouts) / sizeof(layouts[0]); t++)
        if (!strcmp(layouts[t].type, type)) return layouts[t].fields;
    return NULL;
}

/* sizeof(type); 0 for a type not above */
size_t tp_sizeof(const char *type) {
    const field_t *f = fields_of(type);
    if (!f) return 0;
    while (f->name) f++;
    return f->offset;
}

/* type's field i in its order: its name, and its offset and size; NULL past the last */
const char *tp_field(const char *type, int i, size_t *offset, size_t *size) {
    const field_t *f = fields_of(type);
    for (int j = 0; f && f->name && j < i; j++) f++;
    if (!f || !f->name) return NULL;
    *offset = f->offset;
    *size = f->size;
    return f->name;
}
