/* GGUF tensors as the file stores them, for quantization = "gguf": each projection's rows in
 * their own block type (ggml's layouts, ggml-common.h), dotted with activations rounded to int8
 * per 32 values (a step d per 32, the codes' sums per 16).
 *
 * Every block type is read 32 values at a time: its codes as unsigned bytes u (all below 64),
 * an offset o taken from each, a scale for each half of 16 values and a bias a 32 (the minimum of
 * Q4_1, Q5_1 and the K-quants), so that w = s_h * (u - o) + bias. Q8_0's codes are signed and
 * dot as they are. MXFP4 (gpt-oss's) fits the same form: each 4-bit code an FP4 (E2M1) value,
 * read doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives) plus an offset of 12, so u is
 * 0..24 and o 12, under a power-of-two scale a block (E8M0), halved. The reference takes each run's exact integer dot and its float terms in
 * order (run_term); the vector path sums the same products in other lanes, so the two agree up
 * to float rounding. F32, F16 and BF16 rows dot the float activations. Included by step.c.
 */

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30, T_MXFP4 = 39 };

typedef struct { int type, n; const uint8_t *w; } part_t;   /* n rows of one type, as stored */
#define PARTS_MAX 3
typedef struct proj_g { int n, k, parts; part_t part[PARTS_MAX]; } proj_g;   /* the parts' rows in order */

/* the rows' activations: float (x, xstride apart) and rounded: codes q [rows][k], steps d
   [rows][k/32], the codes' sums s [rows][k/16], and d times the sum a run, ds [rows][k/32].
   The same codes again by groups of TR rows for the tiled path (NULL where a view of the rows
   does not start on a group): for run g and group G, 2 * 16 * TR bytes at tq + (g * groups +
   G) * 32 * TR, the group's rows' bytes 0-15 of the run, then their bytes 16-31; d and ds
   again as td [k/32][tstride] (spread to a row's four lanes as the tiles read them: the tiled
   path's loads are its bound) and tds [k/32][tstride]
   (tstride: the rows rounded up to groups, padded with 0). For the one-row path, the codes
   again by pairs of runs, pq [rows][k]: runs 2p and 2p + 1 at 64p as 2p's bytes 0-15, 2p + 1's
   0-15, 2p's 16-31, 2p + 1's 16-31 (a last run without a partner as it is), and each run's four
   lane sums times -16, ls [rows][k/32][4] (lane l: bytes 4l..4l+3 and 16+4l..16+4l+3, the lanes
   the folded dots take; so an offset type's codes dot unsigned from the offset's term on), and
   the same sums by groups as the tiles' lanes take them, in 16 bits (|sum| <= 8 * 127, times
   16: within 16256), tls [k/32][groups][TR * 4]. */
#define TR 4            /* activation rows a group */
typedef struct {
    const float *x; int xstride, k; int8_t *q; float *d; int32_t *s; float *ds;
    int rows, tstride; int8_t *tq; float *td, *tds;
    int8_t *pq; int32_t *ls; int16_t *tls;
    uint32_t *xb; int xbs, amx;  /* the rows in bf16 pairs for the AMX tiles (amx_tiles.h), rows xbs apart:
                               matmuls of amx rows or more, 0 none */
} gact;

typedef struct { float s[2], bias; int o; } sub_t;          /* a run of 32's float terms */

static inline int type_values(int t) {          /* values a block */
    return t == T_Q4_K || t == T_Q5_K || t == T_Q6_K ? 256 : t == T_F32 || t == T_F16 || t == T_BF16 ? 1 : 32;
}

static inline size_t type_bytes(int t) {         /* bytes a block */
    switch (t) {
    case T_F32: return 4;
    case T_F16: case T_BF16: return 2;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    case T_MXFP4: return 17;
    default: return 0;
    }
}

static inline int is_float_type(int t) { return t == T_F32 || t == T_F16 || t == T_BF16; }
static inline size_t row_size(int t, int k) { return (size_t)k / type_values(t) * type_bytes(t); }
static inline int u16_of(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return h; }
static inline float f16_of(const uint8_t *p) { return _cvtsh_ss((unsigned short)u16_of(p)); }
static inline float bf16_of(const uint8_t *p) {
    uint16_t h; memcpy(&h, p, 2);
    const uint32_t u = (uint32_t)h << 16;
    float f; memcpy(&f, &u, 4);
    return f;
}

/* MXFP4: a code's FP4 value doubled plus 12 (an unsigned code, offset 12, as Q4_0's carry 8),
   and a block's E8M0 scale halved to match: 2^(e - 128), ggml's GGML_E8M0_TO_FP32_HALF (e 0
   and 1: the subnormals 2^-128, 2^-127) */
static const uint8_t MXFP4_CODES[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f; memcpy(&f, &bits, 4);
    return f;
}

/* the types whose codes are signed bytes, dotted as they are (no offset) */
static inline int signed_codes(int t) { return t == T_Q8_0; }

/* the K-quants' 6-bit scale and minimum of run j (0-7), packed in 12 bytes */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) { *sc = q[j] & 63; *mn = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

/* run j of the block at b: its float terms (the codes are read by codes_ref or codes_vec) */
INLINE sub_t sub_terms(int t, const uint8_t *b, int j) {
    sub_t r = { {0.f, 0.f}, 0.f, 0 };
    int sc, mn;
    switch (t) {
    case T_Q4_0: r.s[0] = r.s[1] = f16_of(b); r.o = 8; break;
    case T_Q5_0: r.s[0] = r.s[1] = f16_of(b); r.o = 16; break;
    case T_Q8_0: r.s[0] = r.s[1] = f16_of(b); break;
    case T_MXFP4: r.s[0] = r.s[1] = e8m0_half(b[0]); r.o = 12; break;
    case T_Q4_1: case T_Q5_1: r.s[0] = r.s[1] = f16_of(b); r.bias = f16_of(b + 2); break;
    case T_Q4_K: case T_Q5_K:
        scale_min_k4(j, b + 4, &sc, &mn);
        r.s[0] = r.s[1] = f16_of(b) * (float)sc;
        r.bias = -(f16_of(b + 2) * (float)mn);
        break;
    case T_Q6_K: {
        const int8_t *s = (const int8_t *)(b + 192) + 8 * (j / 4) + 2 * (j % 4);
        const float d = f16_of(b + 208);
        r.s[0] = d * (float)s[0];
        r.s[1] = d * (float)s[1];
        r.o = 32;
        break;
    }
    }
    return r;
}

/* run j's 32 codes, one at a time from the layout's definition (Q8_0's: signed, as int8) */
static void codes_ref(int t, const uint8_t *b, int j, uint8_t *u) {
    for (int i = 0; i < 32; i++) {
        const int e = i % 16, hi = i >= 16;
        switch (t) {
        case T_Q4_0: u[i] = hi ? b[2 + e] >> 4 : b[2 + e] & 15; break;
        case T_Q4_1: u[i] = hi ? b[4 + e] >> 4 : b[4 + e] & 15; break;
        case T_Q5_0: case T_Q5_1: {
            const uint8_t *qs = b + (t == T_Q5_0 ? 6 : 8);
            uint32_t qh; memcpy(&qh, b + (t == T_Q5_0 ? 2 : 4), 4);
            u[i] = (uint8_t)((hi ? qs[e] >> 4 : qs[e] & 15) | ((qh >> i) & 1) << 4);
            break;
        }
        case T_Q8_0: u[i] = b[2 + i]; break;
        case T_MXFP4: u[i] = MXFP4_CODES[hi ? b[1 + e] >> 4 : b[1 + e] & 15]; break;
        case T_Q4_K: u[i] = j & 1 ? b[16 + 32 * (j / 2) + i] >> 4 : b[16 + 32 * (j / 2) + i] & 15; break;
        case T_Q5_K: {
            const uint8_t q = b[48 + 32 * (j / 2) + i];
            u[i] = (uint8_t)((j & 1 ? q >> 4 : q & 15) | ((b[16 + i] >> j) & 1) << 4);
            break;
        }
        case T_Q6_K: {
            const uint8_t *ql = b + 64 * (j / 4), *qh = b + 128 + 32 * (j / 4);
            const int t4 = j % 4;
            const uint8_t lo = ql[i + (t4 & 1) * 32];
            u[i] = (uint8_t)((t4 >= 2 ? lo >> 4 : lo & 15) | ((qh[i] >> (2 * t4)) & 3) << 4);
            break;
        }
        }
    }
}

/* a run's share of a dot: I the integer dots of its halves with the activation's codes, A the
   codes' sums, dy the activation's step (the one expression both paths use) */
static inline float run_term(const sub_t *r, int I0, int I1, int A0, int A1, float dy, float acc) {
    float t = r->s[0] * (float)(I0 - r->o * A0);
    t = fmaf(r->s[1], (float)(I1 - r->o * A1), t);
    t = fmaf(r->bias, (float)(A0 + A1), t);
    return fmaf(dy, t, acc);
}

/* the float types: a row's element i */
static inline float float_at(int t, const uint8_t *w, int i) {
    return t == T_F32 ? ((const float *)w)[i] : t == T_F16 ? f16_of(w + 2 * i) : bf16_of(w + 2 * i);
}

/* -- the vector path: a run's codes in one ymm, its integer dots from vpmaddubsw/vpdpbusd -- */

static inline __m256i nibbles(__m128i q) {     /* 16 bytes' low nibbles, then their high ones */
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
}

/* MXFP4_CODES in both lanes: vpshufb turns nibbles into the codes */
static inline __m256i mxfp4_lut(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXFP4_CODES));
}

/* byte i: 0x10 where bit i of the 32 bits is set */
static inline __m256i bits_to_16(uint32_t bits) {
#if WIDE
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(0x10));
#endif
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
    const __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(0x10));
}

INLINE __m256i codes_vec(int t, const uint8_t *b, int j) {
    const __m256i m15 = _mm256_set1_epi8(15);
    uint32_t qh;
    switch (t) {
    case T_Q4_0: return nibbles(_mm_loadu_si128((const __m128i *)(b + 2)));
    case T_Q4_1: return nibbles(_mm_loadu_si128((const __m128i *)(b + 4)));
    case T_Q5_0:
        memcpy(&qh, b + 2, 4);
        return _mm256_or_si256(nibbles(_mm_loadu_si128((const __m128i *)(b + 6))), bits_to_16(qh));
    case T_Q5_1:
        memcpy(&qh, b + 4, 4);
        return _mm256_or_si256(nibbles(_mm_loadu_si128((const __m128i *)(b + 8))), bits_to_16(qh));
    case T_Q8_0: return _mm256_loadu_si256((const __m256i *)(b + 2));
    case T_MXFP4: return _mm256_shuffle_epi8(mxfp4_lut(), nibbles(_mm_loadu_si128((const __m128i *)(b + 1))));
    case T_Q4_K: {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (j / 2)));
        return _mm256_and_si256(j & 1 ? _mm256_srli_epi16(q, 4) : q, m15);
    }
    case T_Q5_K: {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (j / 2)));
        const __m256i bit = _mm256_set1_epi8((char)(1 << j));
        const __m256i h = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(b + 16)), bit), bit);
        return _mm256_or_si256(_mm256_and_si256(j & 1 ? _mm256_srli_epi16(q, 4) : q, m15),
                               _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
    }
    case T_Q6_K: {
        const int t4 = j % 4;
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(b + 64 * (j / 4) + (t4 & 1) * 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * (j / 4)));
        const __m256i h = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t4)), _mm256_set1_epi8(3));
        return _mm256_or_si256(_mm256_and_si256(t4 >= 2 ? _mm256_srli_epi16(lo, 4) : lo, m15),
                               _mm256_slli_epi16(h, 4));
    }
    }
    return _mm256_setzero_si256();
}

static inline void dots_ref(const uint8_t *u, int is_signed, const int8_t *q, int *I0, int *I1) {
    int s[2] = {0, 0};
    for (int i = 0; i < 32; i++) s[i / 16] += (is_signed ? (int)(int8_t)u[i] : (int)u[i]) * q[i];
    *I0 = s[0];
    *I1 = s[1];
}

#define G_ROWS 8        /* activation rows a weight row meets per read of its blocks */
#define TILED_ROWS 4    /* batches of at least this many rows take the tiled path */

/* the reference: y[r] = w . x[r] for activation rows r0 .. r0 + nr (at most G_ROWS), a row w of
   type t, a run and an element at a time, each run's terms in order (run_term) */
static void row_dots_ref(int t, const uint8_t *w, const gact *a, int r0, int nr, float *y) {
    const int k = a->k;
    for (int r = 0; r < nr; r++) {
        const size_t row = (size_t)(r0 + r);
        float acc = 0.f;
        if (is_float_type(t)) {
            const float *x = a->x + row * a->xstride;
            for (int i = 0; i < k; i++) acc = fmaf(float_at(t, w, i), x[i], acc);
        } else {
            const int runs = type_values(t) / 32;
            for (int g = 0; g < k / 32; g++) {
                const uint8_t *b = w + (size_t)(g / runs) * type_bytes(t);
                const sub_t terms = sub_terms(t, b, g % runs);
                uint8_t u[32];
                int I0, I1;
                codes_ref(t, b, g % runs, u);
                dots_ref(u, signed_codes(t), a->q + row * k + 32 * g, &I0, &I1);
                const int32_t *A = a->s + row * (k / 16) + 2 * g;
                acc = run_term(&terms, I0, I1, A[0], A[1], a->d[row * (k / 32) + g], acc);
            }
        }
        y[r] = acc;
    }
}

/* a float row's dot with x, eight lanes at a time */
static float float_row_dot(int t, const uint8_t *w, const float *x, int k) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 v;
        if (t == T_F32) v = _mm256_loadu_ps((const float *)w + i);
        else if (t == T_F16) v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i)));
        else v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 2 * i))), 16));
        acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + i), acc);
    }
    float s = hsum8(acc);
    for (; i < k; i++) s = fmaf(float_at(t, w, i), x[i], s);
    return s;
}

/* a type whose run has a scale for each half of 16 (the others: one a run) */
INLINE int two_scales(int t) { return t == T_Q6_K; }

/* lanes 0 + 2 and 1 + 3, then those two: the order every path's sums take */
static inline float hsum4(__m128 r) {
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* the offset a type's codes carry (taken off as bytes, so the dot of w - o is one int8 dot) */
INLINE int code_offset(int t) { return t == T_Q4_0 ? 8 : t == T_MXFP4 ? 12 : t == T_Q5_0 ? 16 : t == T_Q6_K ? 32 : 0; }

/* a type whose codes less their offset are never negative (the others take the sign trick) */
INLINE int plain_codes(int t) { return t == T_Q4_1 || t == T_Q5_1 || t == T_Q4_K || t == T_Q5_K; }

/* run j of the block at b as both vector paths take it: its float terms, its codes less the
   type's offset (w, signed), and their magnitudes (|w|: the unsigned side of vpdpbusd) */
typedef struct { sub_t terms; __m256i w, aw; } run_t;

INLINE run_t run_of(const int t, const uint8_t *b, const int j) {
    run_t r;
    const int o = code_offset(t);
    r.terms = sub_terms(t, b, j);
    r.w = codes_vec(t, b, j);
    if (o) r.w = _mm256_sub_epi8(r.w, _mm256_set1_epi8((char)o));
    r.aw = plain_codes(t) ? r.w : _mm256_sign_epi8(r.w, r.w);
    return r;
}

/* runs j0 of the block at b0 and j1 of b1, a pair whose folded lanes go side by side: *lo their
   bytes 0-15 (j0's in the low 128 bits), *hi their bytes 16-31, as unsigned codes (Q8_0's
   signed), the offset not taken: the layout pq pairs the activations in. Types of one scale a
   run only. */
INLINE void pair_codes(const int t, const uint8_t *b0, const int j0, const uint8_t *b1, __m256i *lo, __m256i *hi) {
    const __m256i m15 = _mm256_set1_epi8(15);
    int qs;
    uint32_t h0 = 0, h1 = 0;
    switch (t) {
    case T_Q8_0:
        *lo = _mm256_loadu2_m128i((const __m128i *)(b1 + 2), (const __m128i *)(b0 + 2));
        *hi = _mm256_loadu2_m128i((const __m128i *)(b1 + 18), (const __m128i *)(b0 + 18));
        return;
    case T_Q4_K: case T_Q5_K: {     /* one block's runs j0 and j0 + 1: a byte's low and high nibbles */
        const uint8_t *q = b0 + (t == T_Q4_K ? 16 : 48) + 32 * (j0 / 2);
        const __m256i by = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
        *lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q)), by), m15);
        *hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + 16))), by), m15);
        if (t == T_Q5_K) {          /* bit j0 (low half) and j0 + 1 (high half) of each byte of qh */
            const __m256i bit = _mm256_set_m128i(_mm_set1_epi8((char)(2 << j0)), _mm_set1_epi8((char)(1 << j0)));
            const __m256i l = _mm256_and_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + 16))), bit);
            const __m256i h = _mm256_and_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + 32))), bit);
            *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_cmpeq_epi8(l, bit), _mm256_set1_epi8(0x10)));
            *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_cmpeq_epi8(h, bit), _mm256_set1_epi8(0x10)));
        }
        return;
    }
    case T_Q4_0: qs = 2; break;
    case T_MXFP4: qs = 1; break;
    case T_Q4_1: qs = 4; break;
    case T_Q5_0: qs = 6; memcpy(&h0, b0 + 2, 4); memcpy(&h1, b1 + 2, 4); break;
    default: qs = 8; memcpy(&h0, b0 + 4, 4); memcpy(&h1, b1 + 4, 4); break;     /* Q5_1 */
    }
    const __m256i q = _mm256_loadu2_m128i((const __m128i *)(b1 + (size_t)qs), (const __m128i *)(b0 + (size_t)qs));
    *lo = _mm256_and_si256(q, m15);
    *hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m15);
    if (t == T_MXFP4) {              /* the codes through their table */
        *lo = _mm256_shuffle_epi8(mxfp4_lut(), *lo);
        *hi = _mm256_shuffle_epi8(mxfp4_lut(), *hi);
    }
    if (t == T_Q5_0 || t == T_Q5_1) {
        *lo = _mm256_or_si256(*lo, bits_to_16((h0 & 0xFFFFu) | h1 << 16));
        *hi = _mm256_or_si256(*hi, bits_to_16(h0 >> 16 | (h1 & 0xFFFF0000u)));
    }
}

/* a K-quant block's runs' float terms at once (the one-row path meets each block once, so
   sub_terms' scalar decode a run was most of its work): Q4_K and Q5_K's eight scales, then
   their minima's terms; Q6_K's sixteen scales (two a run). The same products as sub_terms. */
#define KS_FLOATS 16
INLINE void block_terms(const int t, const uint8_t *b, float *ks) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    if (t == T_Q6_K) {
        const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        const __m256 d = _mm256_set1_ps(f16_of(b + 208));
        _mm256_storeu_ps(ks, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
        _mm256_storeu_ps(ks + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
        return;
    }
    /* scale_min_k4's bytes, sixteen at once: bytes 0-7 the scales, 8-15 the minima. Runs 0-3
       take q[j] and q[j + 4]'s low six bits; runs 4-7 q[j + 4]'s nibbles under the top two bits
       of q[j - 4] and q[j] */
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
    const __m128i A = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i B = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i hi4 = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1);
    const __m128i low = _mm_and_si128(_mm_blendv_epi8(A, _mm_srli_epi16(A, 4), hi4),
                                      _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
    const __m128i top = _mm_and_si128(_mm_srli_epi16(B, 2), _mm_setr_epi8(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48));
    const __m128i sm = _mm_or_si128(low, top);
    _mm256_storeu_ps(ks, _mm256_mul_ps(_mm256_set1_ps(f16_of(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm))));
    _mm256_storeu_ps(ks + 8, _mm256_xor_ps(sign, _mm256_mul_ps(_mm256_set1_ps(f16_of(b + 2)),
                                                               _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))))));
}

/* run j's float terms: from a block's block_terms where ks is given, else sub_terms */
INLINE sub_t terms_at(const int t, const uint8_t *b, const int j, const float *ks) {
    if (!ks) return sub_terms(t, b, j);
    sub_t r = { {0.f, 0.f}, 0.f, code_offset(t) };
    if (t == T_Q6_K) { r.s[0] = ks[2 * j]; r.s[1] = ks[2 * j + 1]; }
    else { r.s[0] = r.s[1] = ks[j]; r.bias = ks[8 + j]; }
    return r;
}

/* the vector path: each run's codes decoded once into a ymm for the nr activation rows; its
   integer dot's lanes (four bytes each) folded to four (bytes j and 16 + j: one scale a run),
   even runs' into lanes 0-3 and odd runs' into 4-7 of one float vector, or kept as eight where
   each half has its own scale (Q6_K); scaled by the scale times the activation's step and
   summed into float lanes; the minimum's term a float a row. Equal to the reference up to
   float rounding (the sums go in another order), and a row's result does not depend on the
   rows beside it. vec_pair: runs g (at b0, run j0 of its block) and g + 1 (at b1, j1; if pair). */
INLINE void vec_pair(const int t, const int nr, const gact *a, int r0, int g, const uint8_t *b0, const int j0,
                     const uint8_t *b1, const int j1, const int pair, const float *ks, __m256 *acc, float *bias) {
    const int k = a->k, two = two_scales(t), plain = plain_codes(t), o = code_offset(t);
    const sub_t t0 = terms_at(t, b0, j0, ks), t1 = pair ? terms_at(t, b1, j1, ks) : t0;
    if (pair && !two) {        /* both runs' folded lanes from the pair-ordered codes */
        __m256i lo, hi;
        pair_codes(t, b0, j0, b1, &lo, &hi);
        const int sg = signed_codes(t);
        const __m256i alo = sg ? _mm256_sign_epi8(lo, lo) : lo, ahi = sg ? _mm256_sign_epi8(hi, hi) : hi;
        /* [s0, s1]: both blocks' fp16 scales (their first two bytes) in one conversion */
        const __m128 s2 = ks ? _mm_castpd_ps(_mm_load_sd((const double *)(ks + j0)))
                        : t == T_MXFP4 ? _mm_setr_ps(e8m0_half(b0[0]), e8m0_half(b1[0]), 0.f, 0.f)
                             : _mm_cvtph_ps(_mm_insert_epi16(_mm_cvtsi32_si128(u16_of(b0)), u16_of(b1), 1));
        const __m256i two_of = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
        for (int r = 0; r < nr; r++) {
            const size_t row = (size_t)(r0 + r);
            const int8_t *xq = a->pq + row * k + 32 * g;
            __m256i xl = _mm256_loadu_si256((const __m256i *)xq), xh = _mm256_loadu_si256((const __m256i *)(xq + 32));
            if (sg) { xl = _mm256_sign_epi8(xl, lo); xh = _mm256_sign_epi8(xh, hi); }
            /* the offset's term first: -16 times the lane sums (-8 times: halved, exactly) */
            __m256i d = _mm256_setzero_si256();
            if (o) d = _mm256_loadu_si256((const __m256i *)(a->ls + (row * (k / 32) + g) * 4));
            if (o == 8) d = _mm256_srai_epi32(d, 1);
            if (o == 12) d = _mm256_add_epi32(_mm256_srai_epi32(d, 1), _mm256_srai_epi32(d, 2));   /* x 3/4 */
            d = sg ? DPBUSD(DPBUSD(d, alo, xl), ahi, xh) : DPBUSD2(d, alo, xl, ahi, xh);
            /* [s0 * dy0, s1 * dy1] spread to four lanes each: the products rows_tiled takes */
            const __m128 p = _mm_mul_ps(s2, _mm_castpd_ps(_mm_load_sd((const double *)(a->d + row * (k / 32) + g))));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_permutevar8x32_ps(_mm256_castps128_ps256(p), two_of), acc[r]);
            if (plain) {
                bias[r] = fmaf(t0.bias, a->ds[row * (k / 32) + g], bias[r]);
                bias[r] = fmaf(t1.bias, a->ds[row * (k / 32) + g + 1], bias[r]);
            }
        }
        return;
    }
    const run_t even = run_of(t, b0, j0), odd = pair ? run_of(t, b1, j1) : even;   /* codes; terms: t0, t1 */
    const __m256i u0 = even.w, u1 = odd.w, au0 = even.aw, au1 = odd.aw;
    const __m256 sw0 = _mm256_set_m128(_mm_set1_ps(t0.s[1]), _mm_set1_ps(t0.s[0]));
    const __m256 sw1 = _mm256_set_m128(_mm_set1_ps(t1.s[1]), _mm_set1_ps(t1.s[0]));
    for (int r = 0; r < nr; r++) {         /* a run alone, or a pair of two scales a run (Q6_K) */
        const size_t row = (size_t)(r0 + r);
        const int8_t *xq = a->q + row * k + 32 * g;
        __m256i x0 = _mm256_loadu_si256((const __m256i *)xq);
        if (!plain) x0 = _mm256_sign_epi8(x0, u0);
        const __m256i d0 = DPBUSD(_mm256_setzero_si256(), au0, x0);
        __m256i d1 = _mm256_setzero_si256();
        if (pair) {
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 32));
            if (!plain) x1 = _mm256_sign_epi8(x1, u1);
            d1 = DPBUSD(_mm256_setzero_si256(), au1, x1);
        }
        const float dy0 = a->d[row * (k / 32) + g], dy1 = pair ? a->d[row * (k / 32) + g + 1] : 0.f;
        if (two) {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(sw0, _mm256_set1_ps(dy0)), acc[r]);
            if (pair) acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_mul_ps(sw1, _mm256_set1_ps(dy1)), acc[r]);
        } else {
            /* lanes 0-3: the run's dots folded (bytes j and 16 + j) */
            const __m256i folded = _mm256_add_epi32(_mm256_permute2x128_si256(d0, d1, 0x20),
                                                    _mm256_permute2x128_si256(d0, d1, 0x31));
            const __m256 sc = _mm256_set_m128(_mm_set1_ps(t1.s[0] * dy1), _mm_set1_ps(t0.s[0] * dy0));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(folded), sc, acc[r]);
        }
        if (plain) {
            bias[r] = fmaf(t0.bias, a->ds[row * (k / 32) + g], bias[r]);
            if (pair) bias[r] = fmaf(t1.bias, a->ds[row * (k / 32) + g + 1], bias[r]);
        }
    }
}

INLINE void rows_vec(const int t, const int nr, const uint8_t *w, const gact *a, int r0, float *y) {
    const int runs = type_values(t) / 32, nblk = a->k / 32 / runs;
    const size_t bb = type_bytes(t);
    __m256 acc[G_ROWS];
    float bias[G_ROWS];
    for (int r = 0; r < nr; r++) { acc[r] = _mm256_setzero_ps(); bias[r] = 0.f; }
    if (runs > 1)                               /* pairs within a block (the K-quants: 8 runs) */
        for (int blk = 0; blk < nblk; blk++) {
            const uint8_t *b = w + (size_t)blk * bb;
            float ks[KS_FLOATS];
            block_terms(t, b, ks);
            for (int j = 0; j < runs; j += 2) vec_pair(t, nr, a, r0, blk * runs + j, b, j, b, j + 1, 1, ks, acc, bias);
        }
    else                                        /* pairs of blocks of one run */
        for (int blk = 0; blk < nblk; blk += 2)
            vec_pair(t, nr, a, r0, blk, w + (size_t)blk * bb, 0, w + (size_t)(blk + 1) * bb, 0, blk + 1 < nblk, NULL, acc, bias);
    for (int r = 0; r < nr; r++) y[r] = hsum4(_mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1))) + bias[r];
}

static inline void put_rows(float *y, int ystride, int n, const float *out, int r0, int nr, int accumulate) {
    for (int r = 0; r < nr; r++) {
        float *o = y + (size_t)(r0 + r) * ystride + n;
        *o = accumulate ? *o + out[r] : out[r];
    }
}

/* how far ahead of the weight row it reads a thread asks for the bytes it will read next (a
   prefetch never faults, so past a part's end it costs a wasted line at most): the rows stream
   from memory once a step, and at one activation row the hardware's prefetcher alone left the
   loads waiting */
#ifndef STREAM_AHEAD
#define STREAM_AHEAD 4096
#endif

/* rows_vec over nw consecutive weight rows of one type (rs bytes apart) against activation
   rows r0 .. r0 + rows, into y[r][i] (y at the first weight row's column), for each type and
   for 1 and G_ROWS rows, each compiled with both constant (the switches on the type fold away,
   the rows' accumulators stay in registers, and a short row costs no call of its own: the
   head's 262144 rows of 640 did) */
#define ROWS_VEC(T)                                                                               \
    static void rows_vec_##T(const uint8_t *w, size_t rs, int nw, const gact *a, int r0, int rows, \
                             float *y, int ystride, int accumulate) {                             \
        for (int i = 0; i < nw; i++) {                                                            \
            const uint8_t *wi = w + (size_t)i * rs;                                               \
            for (size_t o = 0; o < rs; o += 64) _mm_prefetch((const char *)wi + STREAM_AHEAD + o, _MM_HINT_T0); \
            for (int r1 = r0; r1 < r0 + rows; r1 += G_ROWS) {                                     \
                const int nr = r0 + rows - r1 < G_ROWS ? r0 + rows - r1 : G_ROWS;                 \
                float out[G_ROWS];                                                                \
                if (nr == G_ROWS) rows_vec(T, G_ROWS, wi, a, r1, out);                            \
                else for (int r = 0; r < nr; r++) rows_vec(T, 1, wi, a, r1 + r, out + r);         \
                put_rows(y, ystride, i, out, r1, nr, accumulate);                                 \
            }                                                                                     \
        }                                                                                         \
    }
ROWS_VEC(T_Q4_0) ROWS_VEC(T_Q4_1) ROWS_VEC(T_Q5_0) ROWS_VEC(T_Q5_1) ROWS_VEC(T_Q8_0)
ROWS_VEC(T_Q4_K) ROWS_VEC(T_Q5_K) ROWS_VEC(T_Q6_K) ROWS_VEC(T_MXFP4)

/* The tiled path, for batches: a weight row's runs decoded once for TG groups of TR activation
   rows, each group's rows side by side in a vector (four 32-bit lanes a row, the run's bytes
   0-15 in one vector and 16-31 in another), so a run's scale and the rows' steps cost a vector
   operation a group instead of one a row. Each lane computes what rows_vec's lane of the same
   bytes does, in the same order, so a row's result is rows_vec's bit for bit: batching never
   changes a token. */
#define TG 4            /* groups a weight row's decoded runs meet */

/* the tiled path's share of run g (run j of the block at b) for ng groups from grp: into
   acc (one scale a run), or acc and acc2 (a scale a half: acc2 takes the run's bytes 16-31) */
#if WIDE
typedef __m512 tacc;                        /* a group's four rows: four lanes each */

/* Q4_0, MXFP4, Q5_0 and Q8_0 (one scale a run, an offset or a sign) dot their codes unsigned,
   Q8_0's moved up by 128, from the offset's term on: the lane sums times -16, halved for Q4_0's
   8, times 3/4 for MXFP4's 12, times 8 for Q8_0's 128. The same integers as the sign trick, without negating the rows'
   codes a group at a time. */
INLINE int offset_free(const int t) { return t == T_Q4_0 || t == T_MXFP4 || t == T_Q5_0 || signed_codes(t); }

INLINE void tiled_run_unsigned(const int t, const int ng, const gact *a, int grp, int g, const uint8_t *b,
                               const int j, tacc *acc) {
    const int groups = a->tstride / TR;
    __m256i u = codes_vec(t, b, j);
    if (signed_codes(t)) u = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
    const __m512i ua = _mm512_broadcast_i32x4(_mm256_castsi256_si128(u));
    const __m512i ub = _mm512_broadcast_i32x4(_mm256_extracti128_si256(u, 1));
    const __m512 sa = _mm512_set1_ps(t == T_MXFP4 ? e8m0_half(b[0]) : f16_of(b));
    const int8_t *xg = a->tq + ((size_t)g * groups + grp) * 32 * TR;
    const int16_t *lg = a->tls + ((size_t)g * groups + grp) * 4 * TR;
    const float *dg = a->td + (size_t)g * a->tstride + grp * TR;
    const __m512i fours = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int q = 0; q < ng; q++) {
        __m512i d = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(lg + 4 * TR * q)));
        if (t == T_Q4_0) d = _mm512_srai_epi32(d, 1);
        if (t == T_MXFP4) d = _mm512_add_epi32(_mm512_srai_epi32(d, 1), _mm512_srai_epi32(d, 2));
        if (signed_codes(t)) d = _mm512_slli_epi32(d, 3);
        d = _mm512_dpbusd_epi32(d, ua, _mm512_loadu_si512((const void *)(xg + 32 * TR * q)));
        d = _mm512_dpbusd_epi32(d, ub, _mm512_loadu_si512((const void *)(xg + 32 * TR * q + 16 * TR)));
        const __m512 d4 = _mm512_permutexvar_ps(fours, _mm512_castps128_ps512(_mm_loadu_ps(dg + TR * q)));
        acc[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sa, d4), acc[q]);
    }
}
INLINE void tiled_run(const int t, const int ng, const gact *a, int grp, int g, const uint8_t *b, const int j,
                      const float *ks, tacc *acc, tacc *acc2, __m128 *bias) {
    const int two = two_scales(t), plain = plain_codes(t), groups = a->tstride / TR;
    if (offset_free(t)) { tiled_run_unsigned(t, ng, a, grp, g, b, j, acc); return; }
    const run_t run = run_of(t, b, j);
    const sub_t terms = terms_at(t, b, j, ks);
    const __m256i u = run.w, au = run.aw;
    const __m512i ua = _mm512_broadcast_i32x4(_mm256_castsi256_si128(au));
    const __m512i ub = _mm512_broadcast_i32x4(_mm256_extracti128_si256(au, 1));
    /* the sign trick without vpsignb: x negated where the code is negative (where it is 0,
       |u| = 0 zeroes the product) */
    const __mmask64 na = plain ? 0 : _mm512_movepi8_mask(_mm512_broadcast_i32x4(_mm256_castsi256_si128(u)));
    const __mmask64 nb = plain ? 0 : _mm512_movepi8_mask(_mm512_broadcast_i32x4(_mm256_extracti128_si256(u, 1)));
    const __m512 sa = _mm512_set1_ps(terms.s[0]), sb = _mm512_set1_ps(terms.s[1]);
    const int8_t *xg = a->tq + ((size_t)g * groups + grp) * 32 * TR;
    const float *dg = a->td + (size_t)g * a->tstride + grp * TR, *sg = a->tds + (size_t)g * a->tstride + grp * TR;
    const __m512i fours = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int q = 0; q < ng; q++) {
        __m512i xa = _mm512_loadu_si512((const void *)(xg + 32 * TR * q));
        __m512i xb = _mm512_loadu_si512((const void *)(xg + 32 * TR * q + 16 * TR));
        if (!plain) {
            xa = _mm512_mask_sub_epi8(xa, na, _mm512_setzero_si512(), xa);
            xb = _mm512_mask_sub_epi8(xb, nb, _mm512_setzero_si512(), xb);
        }
        const __m512 d4 = _mm512_permutexvar_ps(fours, _mm512_castps128_ps512(_mm_loadu_ps(dg + TR * q)));
        if (two) {
            const __m512i da = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ua, xa);
            const __m512i db = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ub, xb);
            acc[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(da), _mm512_mul_ps(sa, d4), acc[q]);
            acc2[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(db), _mm512_mul_ps(sb, d4), acc2[q]);
        } else {
            const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ua, xa), ub, xb);
            acc[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sa, d4), acc[q]);
        }
        if (plain) bias[q] = _mm_fmadd_ps(_mm_set1_ps(terms.bias), _mm_loadu_ps(sg + TR * q), bias[q]);
    }
}
INLINE void tacc_zero(tacc *v) { *v = _mm512_setzero_ps(); }
INLINE __m128 tacc_row(const tacc *v, const int i) { return _mm512_extractf32x4_ps(*v, i); }
#else
typedef struct { __m256 h[2]; } tacc;       /* a group's rows 0-1 and 2-3: four lanes a row */
INLINE void tiled_run(const int t, const int ng, const gact *a, int grp, int g, const uint8_t *b, const int j,
                      const float *ks, tacc *acc, tacc *acc2, __m128 *bias) {
    const int two = two_scales(t), plain = plain_codes(t), groups = a->tstride / TR;
    const run_t run = run_of(t, b, j);
    const sub_t terms = terms_at(t, b, j, ks);
    const __m256i u = run.w, au = run.aw;
    const __m256i ua = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(au));
    const __m256i ub = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(au, 1));
    const __m256i va = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(u));
    const __m256i vb = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(u, 1));
    const __m256 sa = _mm256_set1_ps(terms.s[0]), sb = _mm256_set1_ps(terms.s[1]);
    const int8_t *xg = a->tq + ((size_t)g * groups + grp) * 32 * TR;
    const float *dg = a->td + (size_t)g * a->tstride + grp * TR, *sg = a->tds + (size_t)g * a->tstride + grp * TR;
    const __m256i fours = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    for (int q = 0; q < ng; q++) {
        for (int h = 0; h < 2; h++) {
            __m256i xa = _mm256_loadu_si256((const __m256i *)(xg + 32 * TR * q + 32 * h));
            __m256i xb = _mm256_loadu_si256((const __m256i *)(xg + 32 * TR * q + 16 * TR + 32 * h));
            if (!plain) { xa = _mm256_sign_epi8(xa, va); xb = _mm256_sign_epi8(xb, vb); }
            const __m256 d2 = _mm256_permutevar8x32_ps(
                _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double *)(dg + TR * q + 2 * h)))), fours);
            if (two) {
                const __m256i da = DPBUSD(_mm256_setzero_si256(), ua, xa);
                const __m256i db = DPBUSD(_mm256_setzero_si256(), ub, xb);
                acc[q].h[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(da), _mm256_mul_ps(sa, d2), acc[q].h[h]);
                acc2[q].h[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(db), _mm256_mul_ps(sb, d2), acc2[q].h[h]);
            } else {
                const __m256i d = signed_codes(t) ? DPBUSD(DPBUSD(_mm256_setzero_si256(), ua, xa), ub, xb)
                                              : DPBUSD2(_mm256_setzero_si256(), ua, xa, ub, xb);
                acc[q].h[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sa, d2), acc[q].h[h]);
            }
        }
        if (plain) bias[q] = _mm_fmadd_ps(_mm_set1_ps(terms.bias), _mm_loadu_ps(sg + TR * q), bias[q]);
    }
}
INLINE void tacc_zero(tacc *v) { v->h[0] = v->h[1] = _mm256_setzero_ps(); }
INLINE __m128 tacc_row(const tacc *v, const int i) {
    return i % 2 ? _mm256_extractf128_ps(v->h[i / 2], 1) : _mm256_castps256_ps128(v->h[i / 2]);
}
#endif

/* ng groups from grp against weight row w: even runs in acc_a and odd runs in acc_b, as
   rows_vec's lanes 0-3 and 4-7 (a scale a half: every run's bytes 0-15 in acc_a, 16-31 in
   acc_b, as rows_vec's eight lanes) */
INLINE void rows_tiled(const int t, const int ng, const uint8_t *w, const gact *a, int grp, float *y) {
    const int runs = type_values(t) / 32, nblk = a->k / 32 / runs, two = two_scales(t);
    const size_t bb = type_bytes(t);
    tacc acc_a[TG], acc_b[TG];
    __m128 bias[TG];
    for (int q = 0; q < ng; q++) { tacc_zero(acc_a + q); tacc_zero(acc_b + q); bias[q] = _mm_setzero_ps(); }
    tacc *odd = two ? acc_a : acc_b;
    if (runs > 1)
        for (int blk = 0; blk < nblk; blk++) {
            const uint8_t *b = w + (size_t)blk * bb;
            float ks[KS_FLOATS];
            block_terms(t, b, ks);
            for (int j = 0; j < runs; j += 2) {
                tiled_run(t, ng, a, grp, blk * runs + j, b, j, ks, acc_a, acc_b, bias);
                tiled_run(t, ng, a, grp, blk * runs + j + 1, b, j + 1, ks, odd, acc_b, bias);
            }
        }
    else
        for (int blk = 0; blk < nblk; blk += 2) {
            tiled_run(t, ng, a, grp, blk, w + (size_t)blk * bb, 0, NULL, acc_a, acc_b, bias);
            if (blk + 1 < nblk) tiled_run(t, ng, a, grp, blk + 1, w + (size_t)(blk + 1) * bb, 0, NULL, odd, acc_b, bias);
        }
    for (int q = 0; q < ng; q++) {
        float bs[TR];
        _mm_storeu_ps(bs, bias[q]);
        for (int i = 0; i < TR; i++) y[TR * q + i] = hsum4(_mm_add_ps(tacc_row(acc_a + q, i), tacc_row(acc_b + q, i))) + bs[i];
    }
}

/* rows_tiled for each type and for 1 .. TG groups, each compiled with both constant */
#define ROWS_TILED(T)                                                                               \
    static void rows_tiled_##T(const uint8_t *w, const gact *a, int grp, int ng, float *y) {        \
        switch (ng) {                                                                               \
        case 1: rows_tiled(T, 1, w, a, grp, y); return;                                             \
        case 2: rows_tiled(T, 2, w, a, grp, y); return;                                             \
        case 3: rows_tiled(T, 3, w, a, grp, y); return;                                             \
        default: rows_tiled(T, TG, w, a, grp, y); return;                                           \
        }                                                                                           \
    }
ROWS_TILED(T_Q4_0) ROWS_TILED(T_Q4_1) ROWS_TILED(T_Q5_0) ROWS_TILED(T_Q5_1) ROWS_TILED(T_Q8_0)
ROWS_TILED(T_Q4_K) ROWS_TILED(T_Q5_K) ROWS_TILED(T_Q6_K) ROWS_TILED(T_MXFP4)

/* y[TR * q + i] for groups grp .. grp + ng (at most TG) of a weight row w of type t; 0 where
   t has no tiled path (the float types) */
static int groups_dots(int t, const uint8_t *w, const gact *a, int grp, int ng, float *y) {
    switch (t) {
    case T_Q4_0: rows_tiled_T_Q4_0(w, a, grp, ng, y); return 1;
    case T_Q4_1: rows_tiled_T_Q4_1(w, a, grp, ng, y); return 1;
    case T_Q5_0: rows_tiled_T_Q5_0(w, a, grp, ng, y); return 1;
    case T_Q5_1: rows_tiled_T_Q5_1(w, a, grp, ng, y); return 1;
    case T_Q8_0: rows_tiled_T_Q8_0(w, a, grp, ng, y); return 1;
    case T_Q4_K: rows_tiled_T_Q4_K(w, a, grp, ng, y); return 1;
    case T_Q5_K: rows_tiled_T_Q5_K(w, a, grp, ng, y); return 1;
    case T_Q6_K: rows_tiled_T_Q6_K(w, a, grp, ng, y); return 1;
    case T_MXFP4: rows_tiled_T_MXFP4(w, a, grp, ng, y); return 1;
    default: return 0;
    }
}

/* y[r][i] (+)= w_i . x[r] for nw consecutive weight rows of type t and activation rows r0 ..
   r0 + rows: the vector path (vec) or the reference */
static void span_dots(int t, const uint8_t *w, int nw, const gact *a, int r0, int rows, float *y, int ystride,
                      int accumulate, int vec) {
    const size_t rs = row_size(t, a->k);
    switch (vec ? t : -1) {
    case T_Q4_0: rows_vec_T_Q4_0(w, rs, nw, a, r0, rows, y, ystride, accumulate); return;
    case T_Q4_1: rows_vec_T_Q4_1(w, rs, nw, a, r0, rows, y, ystride, accumulate); return;
    case T_Q5_0: rows_vec_T_Q5_0(w, rs, nw, a, r0, rows, y, ystride, accumulate); return;
    case T_Q5_1: rows_vec_T_Q5_1(w, rs, nw, a, r0, rows, y, ystride, accumulate); return;
    case T_Q8_0: rows_vec_T_Q8_0(w, rs, nw, a, r0, rows, y, ystride, accumulate); return;
    case T_Q4_K: rows_vec_T_Q4_K(w, rs, nw, a, r0, rows, y, ystride, accumulate); return;
    case T_Q5_K: rows_vec_T_Q5_K(w, rs, nw, a, r0, rows, y, ystride, accumulate); return;
    case T_Q6_K: rows_vec_T_Q6_K(w, rs, nw, a, r0, rows, y, ystride, accumulate); return;
    case T_MXFP4: rows_vec_T_MXFP4(w, rs, nw, a, r0, rows, y, ystride, accumulate); return;
    default:
        for (int i = 0; i < nw; i++)
            for (int r1 = r0; r1 < r0 + rows; r1 += G_ROWS) {
                const int nr = r0 + rows - r1 < G_ROWS ? r0 + rows - r1 : G_ROWS;
                float out[G_ROWS];
                if (vec)
                    for (int r = 0; r < nr; r++)
                        out[r] = float_row_dot(t, w + (size_t)i * rs, a->x + (size_t)(r1 + r) * a->xstride, a->k);
                else row_dots_ref(t, w + (size_t)i * rs, a, r1, nr, out);
                put_rows(y, ystride, i, out, r1, nr, accumulate);
            }
    }
}

static inline int groups_up(int rows) { return (rows + TR - 1) / TR * TR; }

/* floats the activations' layouts take (gact_layout) */
static inline long gact_floats(int rows, int k) {
    const long P = groups_up(rows);
    return ((long)rows * k * 2 + P * k) / 4 + (long)rows * (k / 32 * 6 + k / 16) + P * (k / 32) * 4 + 16
           + (long)(rows + 48) * k / 2 + 16;
}

/* the activations' layout in the scratch at `at` (gact_floats(rows, k) floats) */
static gact gact_layout(float *at, int rows, int k, const float *x, int xstride) {
    gact a = { x, xstride, k, (int8_t *)at, NULL, NULL, NULL, rows, groups_up(rows), NULL, NULL, NULL, NULL, NULL, NULL,
               NULL, (rows + 47) / 16 * 16, 0 };
    a.d = (float *)(a.q + (size_t)rows * k);
    a.s = (int32_t *)(a.d + (size_t)rows * (k / 32));
    a.ds = (float *)(a.s + (size_t)rows * (k / 16));
    a.td = a.ds + (size_t)rows * (k / 32);
    a.tds = a.td + (size_t)a.tstride * (k / 32);
    a.tq = (int8_t *)(a.tds + (size_t)a.tstride * (k / 32));
    a.ls = (int32_t *)(a.tq + (size_t)a.tstride * k);
    a.pq = (int8_t *)(a.ls + (size_t)rows * (k / 32) * 4);
    a.tls = (int16_t *)(a.pq + (size_t)rows * k);
    a.xb = (uint32_t *)(((uintptr_t)(a.tls + (size_t)(k / 32) * a.tstride * 4) + 63) & ~(uintptr_t)63);
    return a;
}

/* row r's run g (codes q, step d, d times the sum ds, lane sums ls4) into the groups' layout */
static inline void tile_run(const gact *a, int r, int g, const int8_t *q, float d, float ds, const int32_t *ls4) {
    const int groups = a->tstride / TR;
    int8_t *t = a->tq + ((size_t)g * groups + r / TR) * 32 * TR + 16 * (r % TR);
    memcpy(t, q, 16);
    memcpy(t + 16 * TR, q + 16, 16);
    int16_t *l = a->tls + ((size_t)g * groups + r / TR) * 4 * TR + 4 * (r % TR);
    for (int i = 0; i < 4; i++) l[i] = (int16_t)ls4[i];
    a->td[(size_t)g * a->tstride + r] = d;
    a->tds[(size_t)g * a->tstride + r] = ds;
}

static inline int isum8(__m256i v) {
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(2, 3, 0, 1))));
}

#include "amx_tiles.h"

/* row r of a.x rounded: per 32 values, d = max |x| / 127 and codes lrint(x / d) (round to
   nearest even, as lrintf in the default rounding mode), eight at a time */
static void gquantize_row(const gact *a, int r) {
    const int k = a->k;
    const float *x = a->x + (size_t)r * a->xstride;
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int g = 0; g < k / 32; g++) {
        const float *v = x + 32 * g;
        __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(v));
        for (int i = 8; i < 32; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float d = amax / 127.f, id = d >= FLT_MIN ? 1.f / d : 0.f;   /* 1 / d finite: codes within 127 */
        int8_t *q = a->q + (size_t)r * k + 32 * g;
        __m256i c[4];
        for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), _mm256_set1_ps(id)));
        /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back */
        const __m256i p16a = _mm256_packs_epi32(c[0], c[1]), p16b = _mm256_packs_epi32(c[2], c[3]);
        const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)q, p8);
        /* the pair-ordered copy: this run's halves at 16 * (g % 2) and 32 + 16 * (g % 2) of its pair */
        int8_t *pq = a->pq + (size_t)r * k + (g < k / 64 * 2 ? 64 * (g / 2) + 16 * (g % 2) : 32 * g);
        const int gap = g < k / 64 * 2 ? 32 : 16;
        _mm_storeu_si128((__m128i *)pq, _mm256_castsi256_si128(p8));
        _mm_storeu_si128((__m128i *)(pq + gap), _mm256_extracti128_si256(p8, 1));
        /* lane l's sum: codes 4l..4l+3 and 16+4l..16+4l+3 (c[0] + c[2]: codes i and 16 + i, i < 8) */
        const __m256i hs = _mm256_hadd_epi32(_mm256_add_epi32(c[0], c[2]), _mm256_add_epi32(c[1], c[3]));
        const __m256i lanes = _mm256_hadd_epi32(hs, hs);    /* [l0 l2 l0 l2 | l1 l3 l1 l3] */
        _mm_storeu_si128((__m128i *)(a->ls + ((size_t)r * (k / 32) + g) * 4),
                         _mm_slli_epi32(_mm_sub_epi32(_mm_setzero_si128(), _mm256_castsi256_si128(
                             _mm256_permutevar8x32_epi32(lanes, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0)))), 4));
        const int s0 = isum8(_mm256_add_epi32(c[0], c[1])), s1 = isum8(_mm256_add_epi32(c[2], c[3]));
        a->d[(size_t)r * (k / 32) + g] = d;
        a->s[(size_t)r * (k / 16) + 2 * g] = s0;
        a->s[(size_t)r * (k / 16) + 2 * g + 1] = s1;
        a->ds[(size_t)r * (k / 32) + g] = d * (float)(s0 + s1);
        if (a->tq) {
            tile_run(a, r, g, q, d, d * (float)(s0 + s1), a->ls + ((size_t)r * (k / 32) + g) * 4);
            if (r == a->rows - 1)                  /* the last group's padding rows: zeros */
                for (int p = r + 1; p < a->tstride; p++) tile_run(a, p, g, (const int8_t[32]){0}, 0.f, 0.f, (const int32_t[4]){0});
        }
    }
#if HAVE_AMX
    if (a->amx) amx_round_row(a, r);
#endif
}

/* weight row n of p: its type and bytes, and how many rows of its part follow it (itself
   included) */
static inline const uint8_t *weight_row(const proj_g *p, int n, int *type, int *left) {
    int i = 0, first = 0;
    while (n - first >= p->part[i].n) first += p->part[i++].n;
    *type = p->part[i].type;
    *left = p->part[i].n - (n - first);
    return p->part[i].w + (size_t)(n - first) * row_size(p->part[i].type, p->k);
}

#define N_BLOCK 32      /* weight rows that meet one tile of activation rows while it is in L1 */

/* y[r][n] (+)= W[n] . x[r]: weight rows split across threads (inside a parallel region). A
   batch takes the tiled path: blocks of N_BLOCK weight rows, each block's rows against one
   tile of TG * TR activation rows after another (the tile stays in L1, the block in L2). */
static void matmul_g(const proj_g *p, int rows, const gact *a, float *y, int ystride, int accumulate, int vec) {
#if HAVE_AMX
    if (vec && a->amx && rows >= a->amx && amx_takes(p)) { matmul_amx(p, rows, a, y, ystride, accumulate); return; }
#endif
    const int tiled = vec && a->tq && rows >= TILED_ROWS;
    #pragma omp for schedule(static)
    for (int n0 = 0; n0 < p->n; n0 += N_BLOCK) {
        const int n1 = n0 + N_BLOCK < p->n ? n0 + N_BLOCK : p->n;
        if (tiled)
            for (int r0 = 0; r0 < rows; r0 += TG * TR) {
                const int ng = (rows - r0 + TR - 1) / TR < TG ? (rows - r0 + TR - 1) / TR : TG;
                const int nr = rows - r0 < ng * TR ? rows - r0 : ng * TR;   /* padding rows dropped */
                for (int n = n0; n < n1; n++) {
                    int t, left;
                    const uint8_t *w = weight_row(p, n, &t, &left);
                    (void)left;
                    float out[TG * TR];
                    if (is_float_type(t))
                        for (int r = 0; r < nr; r++) out[r] = float_row_dot(t, w, a->x + (size_t)(r0 + r) * a->xstride, a->k);
                    else groups_dots(t, w, a, r0 / TR, ng, out);
                    put_rows(y, ystride, n, out, r0, nr, accumulate);
                }
            }
        else
            for (int n = n0; n < n1;) {         /* the block's rows a part at a time */
                int t, left;
                const uint8_t *w = weight_row(p, n, &t, &left);
                const int nw = n1 - n < left ? n1 - n : left;
                span_dots(t, w, nw, a, 0, rows, y + n, ystride, accumulate, vec);
                n += nw;
            }
    }
}
