/* Prefill on the matrix engine: a stored projection's matmul on AMX bf16 tiles, for steps of
 * step_t.amx rows or more (24 by default, AMX_ROWS in __init__.py: the crossover measured in
 * benchmarks/amx_crossover.py). Included by step.c after gguf_blocks.h.
 *
 * The int8 paths round activations to 8 bits a run and apply each run's scales in float, which
 * AMX's int8 tiles cannot do inside a dot over more than 32 values. bf16 tiles can: each thread
 * decodes a panel of AMX_N weight rows (any stored type, w = s * (u - o) + bias a run) into bf16
 * once, and every block of AMX_M activation rows (bf16, laid out in the tiles' pair order beside
 * the int8 codes when the row is rounded) meets it with TDPBF16PS, float32 sums over the whole
 * row. Decoding costs a pass over the weights a step, so few rows keep the int8 paths.
 *
 * Activations keep 16 bits (bf16: 8 bits of mantissa, the exponent of float32) instead of a
 * run's 8-bit codes, and weights are rounded to bf16 after their decoding: a row's result is
 * not the int8 path's, and a row computed in a step that takes the tiles differs from the
 * same row computed in a smaller one (tested against a float reference on the same bf16 values).
 *
 * Linux lends a process AMX's 8 KiB of tile state only when asked (arch_prctl
 * ARCH_REQ_XCOMP_PERM): amx_request() asks once; a refusal, or a build without AMX, leaves the
 * int8 paths. Each thread loads the tile configuration at a matmul's start and releases the
 * tiles at its end.
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_AMX 1
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define HAVE_AMX 0
#endif

static inline const uint8_t *weight_row(const proj_g *p, int n, int *type, int *left);


/* a projection whose rows are all blocks of codes: float rows (F32, F16, BF16) keep their float
   path, which bf16 would round */
static inline int amx_takes(const proj_g *p) {
    for (int i = 0; i < p->parts; i++) if (is_float_type(p->part[i].type)) return 0;
    return 1;
}

/* a's rows in bf16 for the tiles where tiles exist and the step has ``from`` rows or more (0:
   never); a.amx is then that threshold, which each matmul's rows meet or not */
static inline gact gact_tiles(gact a, int from) { a.amx = HAVE_AMX && from > 0 && a.rows >= from ? from : 0; return a; }
#define AMX_M 32        /* activation rows a block: two A tiles of 16 */
#define AMX_N 32        /* weight rows a panel: two B tiles of 16 */

/* 1: tiles usable; 0: this build has no AMX (the CPU or the compiler lacks it); -1: the kernel
   refused the tile state (asked once a process) */
int amx_request(void) {
#if HAVE_AMX
    static int state = 2;
    if (state == 2) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) ? -1 : 1;
    return state;
#else
    return 0;
#endif
}

#if HAVE_AMX
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

/* every tile 16 rows of 64 bytes: C float32 16 x 16 (0-3), A bf16 16 x 32 (4, 5), B bf16
   pairs 16 x 16 (6, 7) */
static void amx_configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) { c.colsb[i] = 64; c.rows[i] = 16; }
    _tile_loadconfig(&c);
}

/* run g of a stored row as 32 floats: values 0-15 in *lo, 16-31 in *hi */
INLINE void amx_run(int t, const uint8_t *w, int g, __m512 *lo, __m512 *hi) {
    if (is_float_type(t)) {
        const uint8_t *at = w + (size_t)32 * g * (t == T_F32 ? 4 : 2);
        if (t == T_F32) { *lo = _mm512_loadu_ps(at); *hi = _mm512_loadu_ps(at + 64); return; }
        const __m256i a = _mm256_loadu_si256((const __m256i *)at), b = _mm256_loadu_si256((const __m256i *)(at + 32));
        if (t == T_F16) { *lo = _mm512_cvtph_ps(a); *hi = _mm512_cvtph_ps(b); return; }
        *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(a), 16));
        *hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
        return;
    }
    const int runs = type_values(t) / 32;
    const run_t r = run_of(t, w + (size_t)(g / runs) * type_bytes(t), g % runs);   /* codes less the offset */
    const __m512 bias = _mm512_set1_ps(r.terms.bias);
    *lo = _mm512_fmadd_ps(_mm512_set1_ps(r.terms.s[0]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(r.w))), bias);
    *hi = _mm512_fmadd_ps(_mm512_set1_ps(r.terms.s[1]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(r.w, 1))), bias);
}

/* a stored row of K values of type t into bf16 */
INLINE void amx_row_as(const int t, const uint8_t *w, int K, uint16_t *o) {
    for (int c = 0; c < K / 32; c++) {
        __m512 lo, hi;
        amx_run(t, w, c, &lo, &hi);
        _mm512_storeu_si512(o + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* ... one loop a type, each with its type's decoding inlined (a decode that switched on the
   type a run took 1.2 ms for 16,384 Q8_0 rows of 640 on a 2-core Xeon, most of a 32-row
   step's head) */
static void amx_row(int t, const uint8_t *w, int K, uint16_t *o) {
    switch (t) {
    case T_Q4_0: amx_row_as(T_Q4_0, w, K, o); break;
    case T_Q4_1: amx_row_as(T_Q4_1, w, K, o); break;
    case T_Q5_0: amx_row_as(T_Q5_0, w, K, o); break;
    case T_Q5_1: amx_row_as(T_Q5_1, w, K, o); break;
    case T_Q8_0: amx_row_as(T_Q8_0, w, K, o); break;
    case T_Q4_K: amx_row_as(T_Q4_K, w, K, o); break;
    case T_Q5_K: amx_row_as(T_Q5_K, w, K, o); break;
    case T_Q6_K: amx_row_as(T_Q6_K, w, K, o); break;
    case T_MXFP4: amx_row_as(T_MXFP4, w, K, o); break;
    default: amx_row_as(t, w, K, o);
    }
}

/* weight rows n0 .. n0 + nw (nw <= AMX_N) decoded into bf16, row after row as stored (the A
   tiles take 16 rows of 32 values a load); rows past nw zero */
static void amx_panel(const proj_g *p, int n0, int nw, uint16_t *panel) {
    const int K = p->k;
    for (int i = 0; i < AMX_N; i++) {
        uint16_t *o = panel + (size_t)i * K;
        if (i >= nw) {
            memset(o, 0, (size_t)2 * K);
            continue;
        }
        int t, left;
        const uint8_t *w = weight_row(p, n0 + i, &t, &left);
        (void)left;
        amx_row(t, w, K, o);
    }
}

/* row r of a's float activations into the B tiles' layout, a->xb: its values k and k + 1 as one
   32-bit pair at [k / 32][k % 32 / 2][r], rows a->xbs apart (the tiles take 16 rows' pairs a
   load, 16 pairs of each) */
static void amx_round_row(const gact *a, int r) {
    const float *x = a->x + (size_t)r * a->xstride;
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(a->xbs));
    for (int c = 0; c < a->k / 32; c++)
        _mm512_i32scatter_epi32(a->xb + (size_t)c * 16 * a->xbs + r, at,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 32 * c + 16), _mm512_loadu_ps(x + 32 * c)), 4);
}

/* y[r][n] (+)= W[n] . x[r] on the tiles (inside a parallel region): panels of AMX_N weight rows
   split across threads, each panel meeting every block of AMX_M activation rows. The weights
   are the A side (rows as stored), the activations the B side (laid out once a row), so the
   tiles hold y's transpose, turned as it is written out. */
static void matmul_amx(const proj_g *p, int rows, const gact *a, float *y, int ystride, int accumulate) {
    static __thread uint16_t *panel;
    static __thread size_t held;
    const int K = p->k, C = K / 32;
    const size_t need = (size_t)AMX_N * K * sizeof(uint16_t);
    if (held < need) {
        free(panel);
        panel = aligned_alloc(64, need);
        held = panel ? need : 0;
    }
    amx_configure();
    #pragma omp for schedule(static)
    for (int n0 = 0; n0 < p->n; n0 += AMX_N) {
        const int nw = p->n - n0 < AMX_N ? p->n - n0 : AMX_N;
        amx_panel(p, n0, nw, panel);
        for (int m0 = 0; m0 < rows; m0 += AMX_M) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int c = 0; c < C; c++) {
                const uint32_t *b = a->xb + (size_t)c * 16 * a->xbs + m0;
                _tile_loadd(4, panel + 32 * c, 2 * K);
                _tile_loadd(5, panel + (size_t)16 * K + 32 * c, 2 * K);
                _tile_loadd(6, b, 4 * a->xbs);
                _tile_loadd(7, b + 16, 4 * a->xbs);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            float out[AMX_N][AMX_M];            /* [weight row][activation row] */
            _tile_stored(0, &out[0][0], 4 * AMX_M);
            _tile_stored(1, &out[0][16], 4 * AMX_M);
            _tile_stored(2, &out[16][0], 4 * AMX_M);
            _tile_stored(3, &out[16][16], 4 * AMX_M);
            const int nr = rows - m0 < AMX_M ? rows - m0 : AMX_M;
            for (int m = 0; m < nr; m++) {
                float *yr = y + (size_t)(m0 + m) * ystride + n0;
                for (int n = 0; n < nw; n++) yr[n] = accumulate ? yr[n] + out[n][m] : out[n][m];
            }
        }
    }
    _tile_release();
}
#endif
