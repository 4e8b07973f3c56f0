/* A prompt chunk's attention on the matrix engine: AMX bf16 tiles for the rows of a step that
 * are one sequence's consecutive positions, step_t.amx of them or more (decodes and short
 * chunks keep the vector path). Included by step.c before attention().
 *
 * Prefill's attention is two matrix products a layer, quadratic in the prompt: Gemma 3 270M's
 * pp512 spent 41% of its step in it on the float32 vector units (about 74 GFLOP/s on a 2-core
 * Xeon whose bf16 tiles give 1,956). A task here is ATT_M query vectors or fewer: TP
 * consecutive positions times the G query heads of one K/V head. Its keys (the union of its
 * rows' causal windows) are taken ATT_KP at a time, decoded from the pool as the vector path
 * decodes them (rows_float) and rounded to bf16, and meet the queries flash-attention's way:
 *  - scores transposed, S^T = K Q^T: the keys are the tiles' A side as they lie (a row each),
 *    the queries the B side, laid out in the tiles' pair order once a task;
 *  - the softmax down each query's column of S^T, 16 queries a vector: masked to its own keys,
 *    with a running maximum and sum, the output rescaled when the maximum grows;
 *  - O += P V: P turned to rows (16 x 16 transposes in registers) is the A side, V in pair
 *    order (two keys' values interleaved) the B side, O's tiles loaded from and stored to
 *    float32 rows between parts.
 * Sums are float32. A score is kh qh + kh ql + kl qh, each of q and k split into its bf16 and
 * the bf16 of what that left: about 16 bits of each where one bf16 product keeps 8, for a
 * tenth more time (SmolLM2's GGUF, 600 tokens: KL from float32 torch 0.00043, 0.00054 with
 * q.k in bf16 alone, 0.00040 on the vector path). The softmax's weights and the values are
 * rounded to bf16 (as a bf16 flash attention rounds them), so a row's output is not the vector
 * path's bits: tested against float64 attention, and the other rows of the same step against
 * their vector path's bits.
 */

#define ATT_KP 128      /* keys a part: their K and V in bf16 stay in L1/L2 beside the scores */
#define ATT_M 64        /* query vectors a task (more where one position's G heads are more) */

/* query vectors a task holds at most: ATT_M, or G rounded up to the 32 a pair of tiles takes */
static inline int att_m(const model_t *m) {
    const int G = m->heads / m->kv_heads, g32 = (G + 31) / 32 * 32;
    return g32 > ATT_M ? g32 : ATT_M;
}

/* consecutive positions a task takes */
static inline int att_positions(const model_t *m) { return att_m(m) / (m->heads / m->kv_heads); }

/* floats of a thread's scratch for its tasks (0 where this build has no tiles) */
static long amx_attn_floats(const model_t *m) {
#if HAVE_AMX
    const long M = att_m(m), hd = m->head_dim;
    return 2 * M * hd                   /* queries in bf16 pairs (qh, ql); outputs */
         + 4 * M                        /* maxima, sums, keys' bounds */
         + (long)ATT_KP * hd * 3 / 2    /* keys in bf16 (kh, kl); values in pairs */
         + 32 * hd                      /* rows decoded */
         + (long)ATT_KP * M * 3 / 2;    /* scores; weights in bf16 */
#else
    (void)m;
    return 0;
#endif
}

/* whether this step's long prompt chunks take the tiles: asked (s->amx), rows enough for one
   (a decode step of fewer pays nothing), lent (amx_request: asked by the backend at load, so
   the threads only read its answer), and heads the tiles divide (32 values a row) */
static inline int amx_attends(const model_t *m, const step_t *s) {
#if HAVE_AMX
    return s->amx > 0 && s->rows >= s->amx && m->head_dim % 32 == 0 && amx_request() == 1;
#else
    (void)m; (void)s;
    return 0;
#endif
}

/* each row's part in the tiles' attention, into blk: the positions of the task it starts (a
   chunk's rows TP at a time), -1 for the task's other rows, 0 for the vector path's rows */
static void amx_mark_tasks(const model_t *m, const step_t *s, int32_t *blk) {
    const int TP = att_positions(m);
    for (int a = 0, z; a < s->rows; a = z) {
        for (z = a + 1; z < s->rows && s->seq[z] == s->seq[a] && s->ctx[z] == s->ctx[z - 1] + 1; z++) {}
        for (int r = a; r < z; r++) blk[r] = z - a < s->amx ? 0 : (r - a) % TP ? -1 : z - r < TP ? z - r : TP;
    }
}

#if HAVE_AMX
/* r (16 rows of 16) transposed in place: pairs interleaved, 4 x 4 blocks within each 128-bit
   lane, then the lanes themselves */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {       /* row 4L + j: lane L of r[j], r[4 + j], r[8 + j], r[12 + j] */
        const __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), b = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
        const __m512 c = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88), d = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
        t[j] = _mm512_shuffle_f32x4(a, c, 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(b, d, 0x88);
        t[8 + j] = _mm512_shuffle_f32x4(a, c, 0xDD);
        t[12 + j] = _mm512_shuffle_f32x4(b, d, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* 32 floats as 32 bf16 (to nearest even): x[0..15] the low half */
static inline __m512i bf16_32(const float *x) {
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
}

/* what rounding x (32 floats) to h = bf16_32(x) left, in bf16 */
static inline __m512i bf16_rest(const float *x, __m512i h) {
    const __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
    const __m512 h1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(_mm512_loadu_ps(x + 16), h1), _mm512_sub_ps(_mm512_loadu_ps(x), h0));
}

/* a task's scratch, carved from a thread's amx_attn_floats */
typedef struct {
    uint32_t *qt;       /* [2][hd/32][Mp/16][16][16] the queries' dimension pairs, B tiles */
    float *o;           /* [Mp][hd] outputs so far, unnormalised */
    float *best, *sum;  /* [Mp] each query's running maximum and sum of weights */
    int32_t *first, *end;   /* [Mp] each query's keys: [first, end) */
    uint16_t *k;        /* [2][ATT_KP][hd] the part's keys, A tiles' rows */
    uint32_t *vp;       /* [ATT_KP/32][hd/16][16][16] its values, two keys' interleaved, B tiles */
    float *fl;          /* [32][hd] keys or values decoded */
    float *st;          /* [ATT_KP][Mp] scores, keys by queries; then the weights */
    uint16_t *p;        /* [Mp][ATT_KP] the weights in bf16, A tiles' rows */
} att_scratch;

static att_scratch att_carve(const model_t *m, float *at) {
    const size_t M = att_m(m), hd = m->head_dim;
    att_scratch a;
    a.qt = (uint32_t *)at;
    a.o = at + M * hd;
    a.best = a.o + M * hd;
    a.sum = a.best + M;
    a.first = (int32_t *)(a.sum + M);
    a.end = a.first + M;
    a.k = (uint16_t *)(a.end + M);
    a.vp = (uint32_t *)(a.k + (size_t)2 * ATT_KP * hd);
    a.fl = (float *)(a.vp + (size_t)ATT_KP * hd / 2);
    a.st = a.fl + 32 * hd;
    a.p = (uint16_t *)(a.st + (size_t)ATT_KP * M);
    return a;
}

/* the task's queries (M of Mp; the rest zero) into B tiles' pair order, bf16 and what it left
   (qh, then ql: hd / 32 chunks apart), their keys' bounds, and empty outputs. Query vector mq:
   position r0 + mq / G, head kh * G + mq % G. */
static void att_queries(const model_t *m, const step_t *s, const lay_t *ly, int r0, int kh, int M, int Mp,
                        const float *wide, int W, att_scratch *a) {
    const int hd = m->head_dim, G = m->heads / m->kv_heads;
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(16));
    for (int mq = 0; mq < Mp; mq++) {
        const int r = r0 + mq / G;
        const float *q = wide + (size_t)r * W + (size_t)(kh * G + mq % G) * hd;
        for (int c = 0; c < hd / 32; c++) {
            const __m512i hi = mq < M ? bf16_32(q + 32 * c) : _mm512_setzero_si512();
            _mm512_i32scatter_epi32(a->qt + ((size_t)c * (Mp / 16) + mq / 16) * 256 + mq % 16, at, hi, 4);
            _mm512_i32scatter_epi32(a->qt + ((size_t)(c + hd / 32) * (Mp / 16) + mq / 16) * 256 + mq % 16, at,
                                    mq < M ? bf16_rest(q + 32 * c, hi) : _mm512_setzero_si512(), 4);
        }
        a->first[mq] = mq < M ? first_key(ly, s, r) : 0;
        a->end[mq] = mq < M ? s->ctx[r] : 0;
        a->best[mq] = -INFINITY;
        a->sum[mq] = 0.f;
        memset(a->o + (size_t)mq * hd, 0, sizeof(float) * hd);
    }
}

/* keys [b, b + n) of row r's sequence for head kh: K as bf16 rows and what they left (kh, then
   kl: ATT_KP rows apart), V in pairs; past n zero */
static void att_keys(const model_t *m, const step_t *s, const lay_t *ly, int r, int kh, int b, int n,
                     att_scratch *a) {
    const int hd = m->head_dim, n32 = (n + 31) / 32 * 32;
    const int64_t *table = ly->tables + (size_t)s->seq[r] * s->width;
    __m512i lo_idx, hi_idx;                /* two keys' 32 values as 16 pairs: dims 0-15, 16-31 */
    {
        int16_t lo[32], hi[32];
        for (int j = 0; j < 16; j++) { lo[2 * j] = j; lo[2 * j + 1] = 32 + j; hi[2 * j] = 16 + j; hi[2 * j + 1] = 48 + j; }
        lo_idx = _mm512_loadu_si512(lo);
        hi_idx = _mm512_loadu_si512(hi);
    }
    for (int kv = 0; kv < 2; kv++)
        for (int u0 = 0; u0 < n32; u0 += 32) {
            const int cnt = n - u0 < 32 ? n - u0 : 32;
            rows_float(m, s, ly->slot, kv, table, kh, r, b + u0, b + u0 + cnt, a->fl);
            if (cnt < 32) memset(a->fl + (size_t)cnt * hd, 0, sizeof(float) * (32 - cnt) * hd);
            for (int c = 0; c < hd / 32; c++) {
                if (kv == 0) {
                    for (int u = 0; u < 32; u++) {
                        const float *x = a->fl + (size_t)u * hd + 32 * c;
                        const __m512i h = bf16_32(x);
                        _mm512_storeu_si512(a->k + (size_t)(u0 + u) * hd + 32 * c, h);
                        _mm512_storeu_si512(a->k + (size_t)ATT_KP * hd + (size_t)(u0 + u) * hd + 32 * c, bf16_rest(x, h));
                    }
                    continue;
                }
                uint32_t *to = a->vp + ((size_t)(u0 / 32) * (hd / 16) + 2 * c) * 256;
                for (int i = 0; i < 16; i++) {
                    const __m512i x = bf16_32(a->fl + (size_t)(2 * i) * hd + 32 * c);
                    const __m512i y = bf16_32(a->fl + (size_t)(2 * i + 1) * hd + 32 * c);
                    _mm512_storeu_si512(to + 16 * i, _mm512_permutex2var_epi16(x, lo_idx, y));
                    _mm512_storeu_si512(to + 256 + 16 * i, _mm512_permutex2var_epi16(x, hi_idx, y));
                }
            }
        }
}

/* st = K Q^T for the part's n32 keys and the Mp queries, on the tiles */
static void att_scores(const model_t *m, int n32, int Mp, att_scratch *a) {
    const int hd = m->head_dim;
    for (int k0 = 0; k0 < n32; k0 += 32)
        for (int q0 = 0; q0 < Mp; q0 += 32) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int c = 0; c < hd / 32; c++) {      /* k q = kh qh + kh ql + kl qh, in turn */
                const uint32_t *qh = a->qt + ((size_t)c * (Mp / 16) + q0 / 16) * 256, *ql = qh + (size_t)hd / 32 * Mp * 16;
                const uint16_t *kh = a->k + (size_t)k0 * hd + 32 * c, *kl = kh + (size_t)ATT_KP * hd;
                const void *A[3] = {kh, kh, kl}, *B[3] = {qh, ql, qh};
                for (int t = 0; t < 3; t++) {
                    _tile_loadd(4, A[t], 2 * hd);
                    _tile_loadd(5, (const uint16_t *)A[t] + (size_t)16 * hd, 2 * hd);
                    _tile_loadd(6, B[t], 64);
                    _tile_loadd(7, (const uint32_t *)B[t] + 256, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            float *st = a->st + (size_t)k0 * Mp + q0;
            _tile_stored(0, st, 4 * Mp);
            _tile_stored(1, st + 16, 4 * Mp);
            _tile_stored(2, st + (size_t)16 * Mp, 4 * Mp);
            _tile_stored(3, st + (size_t)16 * Mp + 16, 4 * Mp);
        }
}

/* the part's scores (keys [b, b + n)) into softmax weights against each query's running
   maximum, its outputs rescaled where the maximum grew; then the weights as P's bf16 rows */
static void att_weigh(const model_t *m, int b, int n, int n32, int Mp, att_scratch *a) {
    const int hd = m->head_dim;
    const __m512 scale = _mm512_set1_ps(m->scale), ninf = _mm512_set1_ps(-INFINITY);
    const __m512 cap = _mm512_set1_ps(m->attn_cap), inv_cap = _mm512_set1_ps(m->attn_cap ? 1.f / m->attn_cap : 0.f);
    for (int q0 = 0; q0 < Mp; q0 += 16) {
        const __m512i first = _mm512_loadu_si512(a->first + q0), end = _mm512_loadu_si512(a->end + q0);
        /* every key of the part in every query's range (a causal chunk's parts but its last): no masks */
        const int open = b >= _mm512_reduce_max_epi32(first) && b + n <= _mm512_reduce_min_epi32(end);
        const __m512 was = _mm512_loadu_ps(a->best + q0);
        __m512 best = was, total = _mm512_setzero_ps();
        for (int u = 0; u < n; u++) {           /* scaled (and capped) in place; their maximum */
            float *at = a->st + (size_t)u * Mp + q0;
            __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(at), scale);
            if (m->attn_cap) sv = _mm512_mul_ps(cap, tanh16(_mm512_mul_ps(sv, inv_cap)));
            _mm512_storeu_ps(at, sv);
            if (!open) {
                const __m512i key = _mm512_set1_epi32(b + u);
                sv = _mm512_mask_blend_ps(_mm512_cmp_epi32_mask(first, key, _MM_CMPINT_LE) &
                                          _mm512_cmp_epi32_mask(key, end, _MM_CMPINT_LT), ninf, sv);
            }
            best = _mm512_max_ps(best, sv);
        }
        /* queries with no key yet: weights 0 against a base of 0, not e^(-inf + inf) */
        const __m512 base = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(best, ninf, _CMP_EQ_OQ), best, _mm512_setzero_ps());
        for (int u = 0; u < n32; u++) {
            float *at = a->st + (size_t)u * Mp + q0;
            const __m512i key = _mm512_set1_epi32(b + u);
            const __mmask16 in = u >= n ? 0 : open ? 0xFFFF
                               : _mm512_cmp_epi32_mask(first, key, _MM_CMPINT_LE) & _mm512_cmp_epi32_mask(key, end, _MM_CMPINT_LT);
            const __m512 w = _mm512_maskz_mov_ps(in, exp16(_mm512_sub_ps(_mm512_loadu_ps(at), base)));
            _mm512_storeu_ps(at, w);
            total = _mm512_add_ps(total, w);
        }
        const __m512 grow = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(was, ninf, _CMP_NEQ_OQ), exp16(_mm512_sub_ps(was, base)));
        _mm512_storeu_ps(a->sum + q0, _mm512_fmadd_ps(_mm512_loadu_ps(a->sum + q0), grow, total));
        _mm512_storeu_ps(a->best + q0, best);
        float g[16];
        _mm512_storeu_ps(g, grow);
        for (int i = 0; i < 16; i++) {
            if (g[i] == 1.f) continue;
            float *o = a->o + (size_t)(q0 + i) * hd;
            for (int c = 0; c < hd; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), _mm512_set1_ps(g[i])));
        }
        for (int u0 = 0; u0 < n32; u0 += 16) {     /* 16 keys by 16 queries turned to the queries' rows */
            __m512 r[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_ps(a->st + (size_t)(u0 + j) * Mp + q0);
            transpose16(r);
            for (int i = 0; i < 16; i++)
                _mm256_storeu_si256((__m256i *)(a->p + (size_t)(q0 + i) * ATT_KP + u0), (__m256i)_mm512_cvtneps_pbh(r[i]));
        }
    }
}

/* o += P V for the part's n32 keys, on the tiles */
static void att_values(const model_t *m, int n32, int Mp, att_scratch *a) {
    const int hd = m->head_dim;
    for (int q0 = 0; q0 < Mp; q0 += 32)
        for (int d0 = 0; d0 < hd; d0 += 32) {
            float *o = a->o + (size_t)q0 * hd + d0;
            _tile_loadd(0, o, 4 * hd);
            _tile_loadd(1, o + 16, 4 * hd);
            _tile_loadd(2, o + (size_t)16 * hd, 4 * hd);
            _tile_loadd(3, o + (size_t)16 * hd + 16, 4 * hd);
            for (int kc = 0; kc < n32 / 32; kc++) {
                const uint32_t *v = a->vp + ((size_t)kc * (hd / 16) + d0 / 16) * 256;
                _tile_loadd(4, a->p + (size_t)q0 * ATT_KP + 32 * kc, 2 * ATT_KP);
                _tile_loadd(5, a->p + (size_t)(q0 + 16) * ATT_KP + 32 * kc, 2 * ATT_KP);
                _tile_loadd(6, v, 64);
                _tile_loadd(7, v + 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, o, 4 * hd);
            _tile_stored(1, o + 16, 4 * hd);
            _tile_stored(2, o + (size_t)16 * hd, 4 * hd);
            _tile_stored(3, o + (size_t)16 * hd + 16, 4 * hd);
        }
}

/* the task of positions r0 .. r0 + np - 1 for K/V head kh: its outputs into attn (rows QD
   apart), each over its own keys, the G heads' sinks (NULL: none) in the denominators */
static void amx_attend(const model_t *m, const step_t *s, const lay_t *ly, int r0, int np, int kh,
                       const float *wide, int W, float *attn, const float *sink, float *scratch) {
    const int hd = m->head_dim, G = m->heads / m->kv_heads, QD = m->heads * hd;
    const int M = np * G, Mp = (M + 31) / 32 * 32;
    att_scratch a = att_carve(m, scratch);
    att_queries(m, s, ly, r0, kh, M, Mp, wide, W, &a);
    const int lo = a.first[0], hi = a.end[M - 1];
    for (int b = lo; b < hi; b += ATT_KP) {
        const int n = hi - b < ATT_KP ? hi - b : ATT_KP, n32 = (n + 31) / 32 * 32;
        att_keys(m, s, ly, r0 + np - 1, kh, b, n, &a);
        att_scores(m, n32, Mp, &a);
        att_weigh(m, b, n, n32, Mp, &a);
        att_values(m, n32, Mp, &a);
    }
    for (int mq = 0; mq < M; mq++) {
        const int g = mq % G;
        float top = a.best[mq], total = a.sum[mq];
        if (sink) {
            const float was = top;
            top = fmaxf(top, sink[g]);
            total = total * expf(was - top) + expf(sink[g] - top);
        }
        const float f = expf(a.best[mq] - top) / total;
        const float *o = a.o + (size_t)mq * hd;
        float *out = attn + (size_t)(r0 + mq / G) * QD + (size_t)(kh * G + g) * hd;
        for (int c = 0; c < hd; c++) out[c] = o[c] * f;
    }
}
#endif

/* the step's tasks on the tiles (inside the parallel region; blk: amx_mark_tasks's), the
   longest first; no barrier after them: the vector path's rows are others */
static void amx_attention(const model_t *m, const step_t *s, const lay_t *ly, int layer, const float *wide,
                          int W, float *attn, const int32_t *blk, float *scratch) {
#if HAVE_AMX
    const int KVH = m->kv_heads, G = m->heads / KVH;
    int any = 0;                            /* every thread reads the same marks: all skip or none */
    for (int r = 0; r < s->rows && !any; r++) any = blk[r] > 0;
    if (!any) return;
    amx_configure();
    #pragma omp for schedule(dynamic) nowait
    for (int i = s->rows * KVH - 1; i >= 0; i--) {
        const int r = i / KVH, kh = i % KVH;
        if (blk[r] > 0)
            amx_attend(m, s, ly, r, blk[r], kh, wide, W, attn,
                       m->sinks ? m->sinks + (size_t)layer * m->heads + (size_t)kh * G : NULL, scratch);
    }
    _tile_release();
#else
    (void)m; (void)s; (void)ly; (void)layer; (void)wide; (void)W; (void)attn; (void)blk; (void)scratch;
#endif
}
