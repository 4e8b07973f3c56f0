/* GGUF tensors as the file stores them, for quantization = "gguf": each projection's rows in
 * their own block type (ggml's layouts, ggml-common.h), dotted with activations rounded to int8
 * per 32 values (a step d per 32, the codes' sums per 16).
 *
 * Every block type is read 32 values at a time: its codes as unsigned bytes u (all below 64),
 * an offset o taken from each, a scale for each half of 16 values and a bias a 32 (the minimum of
 * Q4_1, Q5_1 and the K-quants), so that w = s_h * (u - o) + bias. Q8_0's codes are signed and
 * dot as they are. The reference takes each run's exact integer dot and its float terms in
 * order (run_term); the vector path sums the same products in other lanes, so the two agree up
 * to float rounding. F32, F16 and BF16 rows dot the float activations. Included by step.c.
 */

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

typedef struct { int type, n; const uint8_t *w; } part_t;   /* n rows of one type, as stored */
#define PARTS_MAX 3
typedef struct proj_g { int n, k, parts; part_t part[PARTS_MAX]; } proj_g;   /* the parts' rows in order */

/* the rows' activations: float (x, xstride apart) and rounded: codes q [rows][k], steps d
   [rows][k/32], the codes' sums s [rows][k/16], and d times the sum a run, ds [rows][k/32] */
typedef struct { const float *x; int xstride, k; int8_t *q; float *d; int32_t *s; float *ds; } gact;

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
    default: return 0;
    }
}

static inline int is_float_type(int t) { return t == T_F32 || t == T_F16 || t == T_BF16; }
static inline size_t row_size(int t, int k) { return (size_t)k / type_values(t) * type_bytes(t); }
static inline float f16_of(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }
static inline float bf16_of(const uint8_t *p) {
    uint16_t h; memcpy(&h, p, 2);
    const uint32_t u = (uint32_t)h << 16;
    float f; memcpy(&f, &u, 4);
    return f;
}

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

/* byte i: 0x10 where bit i of the 32 bits is set */
static inline __m256i bits_to_16(uint32_t bits) {
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
                dots_ref(u, t == T_Q8_0, a->q + row * k + 32 * g, &I0, &I1);
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

/* the offset a type's codes carry (taken off as bytes, so the dot of w - o is one int8 dot) */
INLINE int code_offset(int t) { return t == T_Q4_0 ? 8 : t == T_Q5_0 ? 16 : t == T_Q6_K ? 32 : 0; }

/* the vector path: each run's codes decoded once into a ymm for the nr activation rows; its
   integer dot's eight lanes (four a half) scaled by the half's scale times the activation's
   step and summed into float lanes; the minimum's term a float a row. Equal to the reference
   up to float rounding (the sums go in another order), and a row's result does not depend on
   the rows beside it. */
INLINE void rows_vec(const int t, const int nr, const uint8_t *w, const gact *a, int r0, float *y) {
    const int k = a->k;
    const int runs = type_values(t) / 32, o = code_offset(t);
    const int plain = t == T_Q4_1 || t == T_Q5_1 || t == T_Q4_K || t == T_Q5_K;     /* codes >= 0 */
    const size_t bb = type_bytes(t);
    __m256 acc[G_ROWS];
    float bias[G_ROWS];
    for (int r = 0; r < nr; r++) { acc[r] = _mm256_setzero_ps(); bias[r] = 0.f; }
    for (int blk = 0; blk < k / 32 / runs; blk++) {
        const uint8_t *b = w + (size_t)blk * bb;
        for (int j = 0; j < runs; j++) {
            const int g = blk * runs + j;
            const sub_t terms = sub_terms(t, b, j);
            __m256i u = codes_vec(t, b, j);
            if (o) u = _mm256_sub_epi8(u, _mm256_set1_epi8((char)o));
            const __m256i au = plain ? u : _mm256_sign_epi8(u, u);
            const __m256 sw = t == T_Q6_K ? _mm256_set_m128(_mm_set1_ps(terms.s[1]), _mm_set1_ps(terms.s[0]))
                                          : _mm256_set1_ps(terms.s[0]);
            for (int r = 0; r < nr; r++) {
                const size_t row = (size_t)(r0 + r);
                __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + row * k + 32 * g));
                if (!plain) x = _mm256_sign_epi8(x, u);
                const __m256i dots = DPBUSD(_mm256_setzero_si256(), au, x);
                const __m256 sc = _mm256_mul_ps(sw, _mm256_broadcast_ss(a->d + row * (k / 32) + g));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), sc, acc[r]);
                if (plain) bias[r] = fmaf(terms.bias, a->ds[row * (k / 32) + g], bias[r]);
            }
        }
    }
    for (int r = 0; r < nr; r++) y[r] = hsum8(acc[r]) + bias[r];
}

/* rows_vec for each type and for 1 and G_ROWS rows, each compiled with both constant (the
   switches on the type fold away, the rows' accumulators stay in registers) */
#define ROWS_VEC(T)                                                                               \
    static void rows_vec_##T(const uint8_t *w, const gact *a, int r0, int nr, float *y) {         \
        if (nr == G_ROWS) { rows_vec(T, G_ROWS, w, a, r0, y); return; }                           \
        for (int r = 0; r < nr; r++) rows_vec(T, 1, w, a, r0 + r, y + r);                          \
    }
ROWS_VEC(T_Q4_0) ROWS_VEC(T_Q4_1) ROWS_VEC(T_Q5_0) ROWS_VEC(T_Q5_1) ROWS_VEC(T_Q8_0)
ROWS_VEC(T_Q4_K) ROWS_VEC(T_Q5_K) ROWS_VEC(T_Q6_K)

static void row_dots_vec(int t, const uint8_t *w, const gact *a, int r0, int nr, float *y) {
    switch (t) {
    case T_Q4_0: rows_vec_T_Q4_0(w, a, r0, nr, y); return;
    case T_Q4_1: rows_vec_T_Q4_1(w, a, r0, nr, y); return;
    case T_Q5_0: rows_vec_T_Q5_0(w, a, r0, nr, y); return;
    case T_Q5_1: rows_vec_T_Q5_1(w, a, r0, nr, y); return;
    case T_Q8_0: rows_vec_T_Q8_0(w, a, r0, nr, y); return;
    case T_Q4_K: rows_vec_T_Q4_K(w, a, r0, nr, y); return;
    case T_Q5_K: rows_vec_T_Q5_K(w, a, r0, nr, y); return;
    case T_Q6_K: rows_vec_T_Q6_K(w, a, r0, nr, y); return;
    default:
        for (int r = 0; r < nr; r++) y[r] = float_row_dot(t, w, a->x + (size_t)(r0 + r) * a->xstride, a->k);
    }
}

/* the activations' layout in the scratch at `at` (act_floats(rows, k) floats are enough) */
static gact gact_layout(float *at, int rows, int k, const float *x, int xstride) {
    gact a = { x, xstride, k, (int8_t *)at, NULL, NULL };
    a.d = (float *)(a.q + (size_t)rows * k);
    a.s = (int32_t *)(a.d + (size_t)rows * (k / 32));
    a.ds = (float *)(a.s + (size_t)rows * (k / 16));
    return a;
}

/* row r of a.x rounded: per 32 values, d = max |x| / 127 and codes lrint(x / d) */
static void gquantize_row(const gact *a, int r) {
    const int k = a->k;
    const float *x = a->x + (size_t)r * a->xstride;
    for (int g = 0; g < k / 32; g++) {
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[32 * g + i]));
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int8_t *q = a->q + (size_t)r * k + 32 * g;
        int s0 = 0, s1 = 0;
        for (int i = 0; i < 32; i++) {
            q[i] = (int8_t)lrintf(x[32 * g + i] * id);
            if (i < 16) s0 += q[i]; else s1 += q[i];
        }
        a->d[(size_t)r * (k / 32) + g] = d;
        a->s[(size_t)r * (k / 16) + 2 * g] = s0;
        a->s[(size_t)r * (k / 16) + 2 * g + 1] = s1;
        a->ds[(size_t)r * (k / 32) + g] = d * (float)(s0 + s1);
    }
}

/* y[r][n] (+)= W[n] . x[r]: weight rows split across threads (inside a parallel region) */
static void matmul_g(const proj_g *p, int rows, const gact *a, float *y, int ystride, int accumulate, int vec) {
    #pragma omp for schedule(static)
    for (int n = 0; n < p->n; n++) {
        int i = 0, first = 0;
        while (n - first >= p->part[i].n) first += p->part[i++].n;
        const part_t *pt = p->part + i;
        const uint8_t *w = pt->w + (size_t)(n - first) * row_size(pt->type, p->k);
        for (int r0 = 0; r0 < rows; r0 += G_ROWS) {
            const int nr = rows - r0 < G_ROWS ? rows - r0 : G_ROWS;
            float out[G_ROWS];
            if (vec) row_dots_vec(pt->type, w, a, r0, nr, out);
            else row_dots_ref(pt->type, w, a, r0, nr, out);
            for (int r = 0; r < nr; r++) {
                float *o = y + (size_t)(r0 + r) * ystride + n;
                *o = accumulate ? *o + out[r] : out[r];
            }
        }
    }
}
