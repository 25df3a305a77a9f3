/* A decode step's attention, its norms (add_rms_norm), its linears of a few rows (skinny_linear,
 * fp32 or bf16) and, at those rows, a layer's MLP (mlp_step) and attention block
 * (attn_step) in one call each: these after the attention, in that order.
 *
 * The attention over a slotted KV cache, from the QKV projection's output to the
 * output projection's input: RoPE on the new tokens' queries and keys, the new keys and values
 * written into the cache at their positions, then every query head of each new token attends its
 * own first L keys (a plain step: one token a row; a chain's verify: T tokens a row, token t over
 * its prefix, which holds the tokens before it), read where they lie in the cache, bf16 or fp32,
 * with fp32 sums (the scaled query rounded to the cache's dtype; bf16 scores by the CPU's bf16
 * dot products where it has them). D is a multiple of 8 (the vector loops), at most MAX_DIM.
 *
 * Built by tailrl/decode_kernels.py with the machine's C compiler for the machine's own
 * instruction set; see that module for why it exists and how it is checked.
 *
 * Layout (tailrl.kv_cache.KVCache): keys and values of one layer are (C, K, M, D) with unit stride
 * along D; `slot_stride` and `head_stride` are the element strides of C and K (equal for keys
 * and values). The new tokens' q, k and v are rows of (B x T, heads x D), token t of row b at
 * b x T + t, with unit stride along the row and their own row strides (slices of one fused
 * projection's output); cos, sin (B x T, D), pos and lens (B x T) and out (B x T, H x D) are
 * contiguous. All in the cache's dtype. Query head h*G + g reads kv head h (grouped-query
 * attention, the Hugging Face order). Work is split over threads by (row, kv head): a row's
 * tokens write their keys before any of them reads, within the one work item that owns them.
 */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define DPBF16 1 /* the CPU's bf16 dot products (Zen 4/5, Intel from Cooper Lake): scores of a bf16 cache */
#endif
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 64  /* query rows per kv head, tokens x G: the caller checks */
#define MAX_DIM 256  /* head dim: the caller checks D <= MAX_DIM */
#define MAX_HIDDEN 8192  /* hidden size of add_rms_norm: the caller checks */
#define AHEAD 16 /* keys between a key read and the line prefetched for a later read */

typedef struct {
    const void *q, *k_new, *v_new, *cos, *sin;
    int64_t q_stride, k_stride, v_stride;
    const int64_t *pos;
    const int32_t *lens;
    void *k, *v, *out;
    int64_t batch, tokens, heads, rows, dim, slot_stride, head_stride;
    float scale;
    int bf16;
} job_t;

static inline float from_bf16(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

/* Round to nearest, ties to even, as torch's conversion does for finite values. */
static inline uint16_t to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    return (uint16_t)((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16);
}

/* Elements [at, at + n) of a bf16 or fp32 array, as fp32. */
static inline void load(int bf16, const void *base, int64_t at, int64_t n, float *dst) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)base + at;
        for (int64_t d = 0; d < n; d++) dst[d] = from_bf16(p[d]);
    } else {
        memcpy(dst, (const float *)base + at, (size_t)n * sizeof(float));
    }
}

/* Element `at` of a bf16 or fp32 array set to x (rounded to bf16 to nearest, as torch does). */
static inline void store(int bf16, void *base, int64_t at, float x) {
    if (bf16)
        ((uint16_t *)base)[at] = to_bf16(x);
    else
        ((float *)base)[at] = x;
}

/* Rotate-half RoPE of the D values at `src`[at..] into dst (fp32), with token row b's cos and sin
 * (the Hugging Face layout: x * cos + (-x2, x1) * sin). */
static void rope(const job_t *j, const void *src, int64_t at, int64_t b, float *dst) {
    const int64_t D = j->dim, half = D / 2;
    float x[MAX_DIM], c[MAX_DIM], s[MAX_DIM];
    load(j->bf16, src, at, D, x);
    load(j->bf16, j->cos, b * D, D, c);
    load(j->bf16, j->sin, b * D, D, s);
    for (int64_t d = 0; d < D; d++) dst[d] = x[d] * c[d] + (d < half ? -x[d + half] : x[d - half]) * s[d];
}

#ifdef DPBF16
/* The n query rows' scores over L bf16 keys at `base`, 32 dimensions a dot-product instruction
 * (pairs of bf16 products summed into fp32 lanes); q holds bf16 values as fp32. */
static void scores_bf16(const job_t *j, int64_t base, int64_t n, int64_t L, const float *q, float *scores) {
    const int64_t D = j->dim, chunks = D / 32;
    __m512bh qb[MAX_ROWS][MAX_DIM / 32];
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < chunks; c++)
            qb[i][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + i * D + c * 32 + 16), _mm512_loadu_ps(q + i * D + c * 32));
    const uint16_t *keys = (const uint16_t *)j->k + base;
    for (int64_t s = 0; s < L; s++) {
        __m512bh kc[MAX_DIM / 32];
        for (int64_t c = 0; c < chunks; c++) {
            __builtin_prefetch(keys + (s + AHEAD) * D + c * 32, 0, 0);
            kc[c] = (__m512bh)_mm512_loadu_si512(keys + s * D + c * 32);
        }
        for (int64_t i = 0; i < n; i++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++) acc = _mm512_dpbf16_ps(acc, qb[i][c], kc[c]);
            scores[i * L + s] = _mm512_reduce_add_ps(acc);
        }
    }
}
#endif

/* Eight fp32 lanes, as the compiler maps them onto the machine's vectors (one AVX2 register, two
 * SSE ones); loads through memcpy, so any alignment. The loops below need D % 8 == 0. */
#define W 8
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
#define BLOCK 32 /* keys whose values are widened to fp32 once for all n query rows (8 KB at D = 64) */

/* Eight elements of a bf16 or fp32 array from `at`, as fp32 (bf16: the bits moved up 16). */
static inline vf vload(int bf16, const void *base, int64_t at) {
    vf out;
    if (bf16) {
        vh h;
        memcpy(&h, (const uint16_t *)base + at, sizeof h);
        const vu wide = __builtin_convertvector(h, vu) << 16;
        memcpy(&out, &wide, sizeof out);
    } else {
        memcpy(&out, (const float *)base + at, sizeof out);
    }
    return out;
}

/* A cache line `ahead` keys on (a hint: an address past the row's keys is never read). */
static inline void prefetch(const job_t *j, const void *base, int64_t at) {
    __builtin_prefetch((const char *)base + at * (j->bf16 ? 2 : 4), 0, 0);
}

static inline float hsum(vf v) {
    float s = 0.f;
    for (int l = 0; l < W; l++) s += v[l];
    return s;
}

/* The n query rows' scores over the L keys at `base`: four keys at a time (four independent
 * sums: with one, each FMA waits on the one before), each key widened once for all n rows, the
 * lines AHEAD keys on prefetched (the loop is a stream through the cache: docs/performance.md,
 * "Long contexts"). */
static void scores_vec(const job_t *j, int64_t base, int64_t n, int64_t L, const float *q, float *scores) {
    const int64_t D = j->dim, C = D / W;
    vf k[4 * MAX_DIM / W]; /* key r's dimensions c x 8.. at [r x C + c] */
    for (int64_t s = 0; s < L; s += 4) {
        const int64_t m = L - s < 4 ? L - s : 4;
        for (int64_t r = 0; r < 4; r++)
            for (int64_t c = 0; c < C; c += 2) /* 64 bytes: one line of fp32 */
                prefetch(j, j->k, base + (s + r + AHEAD) * D + c * W);
        for (int64_t r = 0; r < 4; r++)
            for (int64_t c = 0; c < C; c++)
                k[r * C + c] = r < m ? vload(j->bf16, j->k, base + (s + r) * D + c * W) : (vf){0};
        for (int64_t i = 0; i < n; i++) {
            const float *qi = q + i * D;
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t c = 0; c < C; c++) {
                vf qc;
                memcpy(&qc, qi + c * W, sizeof qc);
                a0 += qc * k[0 * C + c];
                a1 += qc * k[1 * C + c];
                a2 += qc * k[2 * C + c];
                a3 += qc * k[3 * C + c];
            }
            const float dots[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
            for (int64_t r = 0; r < m; r++) scores[i * L + s + r] = dots[r];
        }
    }
}

/* acc (n x D) = the n rows' weights (n x L, zero past each row's own keys) times the L values at
 * `base`: BLOCK keys at a time, widened to fp32 once; for each row and each 8 dimensions, four
 * running sums over the block's keys (for the FMA's latency, as above). */
static void values_vec(const job_t *j, int64_t base, int64_t n, int64_t L, const float *p, float *acc) {
    const int64_t D = j->dim, C = D / W;
    vf val[BLOCK * MAX_DIM / W]; /* key s's dimensions c x 8.. at [s x C + c] */
    memset(acc, 0, (size_t)(n * D) * sizeof(float));
    for (int64_t s0 = 0; s0 < L; s0 += BLOCK) {
        const int64_t m = L - s0 < BLOCK ? L - s0 : BLOCK;
        for (int64_t s = 0; s < m; s++) {
            for (int64_t c = 0; c < C; c += 2) /* 64 bytes: one line of fp32 */
                prefetch(j, j->v, base + (s0 + s + AHEAD) * D + c * W);
            for (int64_t c = 0; c < C; c++) val[s * C + c] = vload(j->bf16, j->v, base + (s0 + s) * D + c * W);
        }
        for (int64_t i = 0; i < n; i++) {
            const float *pi = p + i * L + s0;
            float *ai = acc + i * D;
            for (int64_t c = 0; c < C; c++) {
                vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                int64_t s = 0;
                for (; s + 4 <= m; s += 4) {
                    a0 += pi[s] * val[s * C + c];
                    a1 += pi[s + 1] * val[(s + 1) * C + c];
                    a2 += pi[s + 2] * val[(s + 2) * C + c];
                    a3 += pi[s + 3] * val[(s + 3) * C + c];
                }
                for (; s < m; s++) a0 += pi[s] * val[s * C + c];
                vf sum;
                memcpy(&sum, ai + c * W, sizeof sum);
                sum += (a0 + a1) + (a2 + a3);
                memcpy(ai + c * W, &sum, sizeof sum);
            }
        }
    }
}

/* One (row b, kv head h): its T new keys (rotated) and values into the cache at their positions,
 * then the scores of the T x G query rows (token t's G heads, rotated, scaled) over the row's keys,
 * each row's softmax over its token's L_t keys, values. `scores` holds T x G x max_t L_t floats,
 * `q` and `acc` T x G x D. */
static void attend(const job_t *j, int64_t b, int64_t h, float *scores, float *q, float *acc) {
    const int64_t D = j->dim, G = j->rows, T = j->tokens, n = T * G, base = b * j->slot_stride + h * j->head_stride;
    const int32_t *lens = j->lens + b * T;
    float row[MAX_DIM], total[MAX_ROWS];
    int64_t L = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t bt = b * T + t, at = base + j->pos[bt] * D;
        rope(j, j->k_new, bt * j->k_stride + h * D, bt, row);
        for (int64_t d = 0; d < D; d++) store(j->bf16, j->k, at + d, row[d]);
        load(j->bf16, j->v_new, bt * j->v_stride + h * D, D, row);
        for (int64_t d = 0; d < D; d++) store(j->bf16, j->v, at + d, row[d]);
        if (lens[t] > L) L = lens[t];
    }
    /* The scaled query in the cache's dtype, as the torch path holds it: in bf16 the scores are
     * then exact products of bf16 values summed in fp32, whichever loop below computes them.
     * Query row i = t x G + g. */
    for (int64_t i = 0; i < n; i++) {
        const int64_t bt = b * T + i / G;
        rope(j, j->q, bt * j->q_stride + (h * G + i % G) * D, bt, q + i * D);
        for (int64_t d = 0; d < D; d++) q[i * D + d] *= j->scale;
        if (j->bf16)
            for (int64_t d = 0; d < D; d++) q[i * D + d] = from_bf16(to_bf16(q[i * D + d]));
    }
#ifdef DPBF16
    if (j->bf16 && D % 32 == 0) {
        scores_bf16(j, base, n, L, q, scores);
    } else
#endif
    scores_vec(j, base, n, L, q, scores);
    for (int64_t i = 0; i < n; i++) {
        float *sc = scores + i * L, sum = 0.f, best = -FLT_MAX;
        const int64_t own = lens[i / G];
        for (int64_t s = 0; s < own; s++) best = sc[s] > best ? sc[s] : best;
        for (int64_t s = 0; s < own; s++) {
            sc[s] = expf(sc[s] - best);
            sum += sc[s];
        }
        for (int64_t s = own; s < L; s++) sc[s] = 0.f; /* keys after the token's own: masked */
        total[i] = sum;
    }
    values_vec(j, base, n, L, scores, acc);
    for (int64_t i = 0; i < n; i++) {
        const int64_t first = ((b * T + i / G) * j->heads + h) * G * D + (i % G) * D;
        const float r = 1.f / total[i];
        for (int64_t d = 0; d < D; d++) store(j->bf16, j->out, first + d, acc[i * D + d] * r);
    }
}

/* Returns 0 on success; 1 for shapes past the fixed limits, 2 when a thread could not have its
 * buffers (the caller then fails loudly). OpenMP: linked against the libgomp the process already
 * has (torch's), so this runs on torch's own worker threads rather than on threads of its own
 * that would compete with them for the cores. */
int decode_step(const void *q, int64_t q_stride, const void *k_new, int64_t k_stride, const void *v_new,
                int64_t v_stride, const void *cos, const void *sin, const int64_t *pos, const int32_t *lens, void *k,
                void *v, void *out, int64_t batch, int64_t tokens, int64_t heads, int64_t rows, int64_t dim,
                int64_t slot_stride, int64_t head_stride, float scale, int bf16, int threads) {
    if (tokens * rows > MAX_ROWS || dim > MAX_DIM || dim % W) return 1;
    const job_t job = {q, k_new, v_new, cos, sin, q_stride, k_stride, v_stride, pos, lens, k, v, out,
                       batch, tokens, heads, rows, dim, slot_stride, head_stride, scale, bf16};
    const int64_t n = tokens * rows;
    int64_t longest = 1;
    for (int64_t r = 0; r < batch * tokens; r++)
        if (lens[r] > longest) longest = lens[r];
    int status = 0;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads)
    {
        float *buf = malloc(sizeof(float) * (size_t)(n * longest + 2 * n * dim));
        if (!buf) {
#pragma omp atomic write
            status = 2;
        }
#pragma omp for schedule(static, 1)
        for (int64_t w = 0; w < batch * heads; w++)
            if (buf) attend(&job, w / heads, w % heads, buf, buf + n * longest, buf + n * longest + n * dim);
        free(buf);
    }
    return status;
}

typedef struct {
    const void *x, *delta, *w;
    void *x_out, *h;
    int64_t dim;
    float eps;
    int bf16;
} norm_t;

/* One row of add_rms_norm. */
static void norm_row(const norm_t *j, int64_t r) {
    const int64_t dim = j->dim;
    float a[MAX_HIDDEN], b[MAX_HIDDEN], w[MAX_HIDDEN];
    load(j->bf16, j->x, r * dim, dim, a);
    if (j->delta) {
        load(j->bf16, j->delta, r * dim, dim, b);
        for (int64_t d = 0; d < dim; d++) a[d] += b[d];
        if (j->bf16)
            for (int64_t d = 0; d < dim; d++) a[d] = from_bf16(to_bf16(a[d]));
    }
    float squares = 0.f;
    for (int64_t d = 0; d < dim; d++) squares += a[d] * a[d];
    const float scale = 1.f / sqrtf(squares / (float)dim + j->eps);
    load(j->bf16, j->w, 0, dim, w);
    for (int64_t d = 0; d < dim; d++) {
        if (j->delta) store(j->bf16, j->x_out, r * dim + d, a[d]);
        float y = a[d] * scale;
        if (j->bf16) y = from_bf16(to_bf16(y));
        store(j->bf16, j->h, r * dim + d, w[d] * y);
    }
}

/* The residual add and RMSNorm of a decoder layer, as tailrl.model.RMSNorm computes them in the
 * cache's dtype: x_out = round(x + delta) (delta NULL: x_out = x), then
 * h = round(w * round(x_out * rsqrt(mean(x_out^2) + eps))) with the mean in fp32. x, delta,
 * x_out, h: (rows, dim) contiguous; w: (dim,). x_out may be x. Few rows run on the calling
 * thread without entering an OpenMP region at all (a one-thread region through an `if` clause
 * still goes through the runtime: with it, steps of 1-4 rows were slower, docs/performance.md,
 * "Decode attention"). */
int add_rms_norm(const void *x, const void *delta, const void *w, void *x_out, void *h, int64_t rows, int64_t dim,
                 float eps, int bf16, int threads) {
    if (dim > MAX_HIDDEN) return 1;
    const norm_t job = {x, delta, w, x_out, h, dim, eps, bf16};
    if (rows < 16 || threads <= 1) {
        for (int64_t r = 0; r < rows; r++) norm_row(&job, r);
        return 0;
    }
#pragma omp parallel for num_threads(threads)
    for (int64_t r = 0; r < rows; r++) norm_row(&job, r);
    return 0;
}

/* ---- A linear of a few rows (skinny_linear): the fp32 loop here, the bf16 one below ---------------
 *
 * y = x W^T + b for up to three weights that read the same x (q, k, v; gate, up), each into its
 * own columns of y: at a few rows a decode step's linears stream their weights from memory, and
 * oneDNN's prepacked kernel reads them ~10-30% slower than this loop at 1-8 rows on a Zen 3
 * besides its ~28 us a call (docs/performance.md, "Linears of a few rows"). Each weight row is read
 * once for all rows of x: tiles of R weight rows x MB rows of x keep R x MB vector sums in
 * registers (8 or 12 of the 16 AVX2 ones), the weight rows prefetched AHEAD floats on. Threads take
 * contiguous ranges of the weights' rows. x (m, k) with row stride xs, W (n, k) contiguous, K a
 * multiple of 8, y (m, total n) with row stride ys. */
#define LIN_AHEAD 512
#define MAX_WEIGHTS 3

#define TILE(NAME, R, MB)                                                                              \
    static inline void NAME(const float *x, int64_t xs, const float *w, const float *b, float *y,       \
                            int64_t ys, int64_t i, int64_t mm, int64_t r, int64_t nr, int64_t k, int pf) { \
        const float *wr[R], *xr[MB];                                                                     \
        for (int a = 0; a < R; a++) wr[a] = w + (r + (a < nr ? a : 0)) * k; /* past n: row r again */    \
        for (int c = 0; c < MB; c++) xr[c] = x + (i + (c < mm ? c : 0)) * xs;                            \
        vf acc[R][MB];                                                                                   \
        for (int a = 0; a < R; a++)                                                                      \
            for (int c = 0; c < MB; c++) acc[a][c] = (vf){0};                                            \
        for (int64_t d = 0; d < k; d += W) {                                                             \
            vf xv[MB];                                                                                   \
            for (int c = 0; c < MB; c++) xv[c] = vload(0, xr[c], d);                                     \
            for (int a = 0; a < R; a++) {                                                                \
                if (pf && (d & 15) == 0) __builtin_prefetch(wr[a] + d + LIN_AHEAD, 0, 0);                \
                const vf wv = vload(0, wr[a], d);                                                        \
                for (int c = 0; c < MB; c++) acc[a][c] += wv * xv[c];                                    \
            }                                                                                            \
        }                                                                                                \
        for (int a = 0; a < nr; a++)                                                                     \
            for (int c = 0; c < mm; c++) y[(i + c) * ys + r + a] = hsum(acc[a][c]) + (b ? b[r + a] : 0.f); \
    }
TILE(tile1, 8, 1)
TILE(tile2, 6, 2)
TILE(tile8, 1, 8)

/* Rows [r0, r1) of one weight into y's columns from r0 (y already offset to the weight's first column). */
static void linear_rows(const float *x, int64_t xs, const float *w, const float *b, float *y, int64_t ys,
                        int64_t m, int64_t r0, int64_t r1, int64_t k) {
    if (m == 1) {
        for (int64_t r = r0; r < r1; r += 8) tile1(x, xs, w, b, y, ys, 0, 1, r, r1 - r < 8 ? r1 - r : 8, k, 1);
    } else if (m == 2) {
        for (int64_t r = r0; r < r1; r += 6) tile2(x, xs, w, b, y, ys, 0, 2, r, r1 - r < 6 ? r1 - r : 6, k, 1);
    } else {
        for (int64_t r = r0; r < r1; r++)
            for (int64_t i = 0; i < m; i += 8) /* the weight rows stay in L1 after the first MB rows */
                tile8(x, xs, w, b, y, ys, i, m - i < 8 ? m - i : 8, r, 1, k, i == 0);
    }
}

/* Rows [lo, hi) of the weights' concatenated rows. */
static void linear_range(const float *x, int64_t xs, const float *const *w, const float *const *b, const int64_t *n,
                         int count, float *y, int64_t ys, int64_t m, int64_t k, int64_t lo, int64_t hi) {
    int64_t first = 0; /* the current weight's first row in the concatenation */
    for (int j = 0; j < count && first < hi; first += n[j], j++) {
        const int64_t r0 = lo > first ? lo - first : 0, r1 = hi - first < n[j] ? hi - first : n[j];
        if (r0 < r1) linear_rows(x, xs, w[j], b[j], y + first, ys, m, r0, r1, k);
    }
}

/* ---- The same linear in bf16, where the CPU has bf16 dot products -------------------------------
 *
 * bf16 x and W, y = round_bf16(fp32 sum of the exact bf16 products + b), as oneDNN's bf16 kernel
 * computes it (fp32 accumulation, one rounding at the end), in another summation order. 32
 * dimensions an instruction (pairs of products into fp32 lanes); tiles of R weight rows x MB
 * rows of x (8 x 1, 8 x 2, 4 x 4, 2 x 8) keep R x MB sums in 8 or 16 of the 32 AVX-512
 * registers. What made it faster than oneDNN at 1-4 rows is the prefetch: each step of a tile fetches a line of each of the next
 * tile's rows (the fp32 loop's fixed distance ahead, 2 KB, lands in the tile's own later rows
 * when a row is 1 KB). K a multiple of 32. Without the instructions (the build has no DPBF16) it
 * returns 1 and linear_bf16_available() says 0. */
int linear_bf16_available(void) {
#ifdef DPBF16
    return 1;
#else
    return 0;
#endif
}

#ifdef DPBF16
#define BF 32
#define TILE_BF(NAME, R, MB)                                                                            \
    static inline void NAME(const uint16_t *x, int64_t xs, const uint16_t *w, const uint16_t *b, uint16_t *y, \
                            int64_t ys, int64_t i, int64_t mm, int64_t r, int64_t nr, int64_t k, int pf) { \
        const uint16_t *wr[R], *xr[MB];                                                                  \
        for (int a = 0; a < R; a++) wr[a] = w + (r + (a < nr ? a : 0)) * k; /* past n: row r again */    \
        for (int c = 0; c < MB; c++) xr[c] = x + (i + (c < mm ? c : 0)) * xs;                            \
        const uint16_t *next = w + (r + R) * k; /* the next tile's rows, a line per row per step */      \
        __m512 acc[R][MB];                                                                               \
        for (int a = 0; a < R; a++)                                                                      \
            for (int c = 0; c < MB; c++) acc[a][c] = _mm512_setzero_ps();                                \
        for (int64_t d = 0; d < k; d += BF) {                                                            \
            __m512bh xv[MB];                                                                             \
            for (int c = 0; c < MB; c++) xv[c] = (__m512bh)_mm512_loadu_si512(xr[c] + d);                \
            for (int a = 0; a < R; a++) {                                                                \
                if (pf) __builtin_prefetch(next + ((d / BF) * R + a) * BF, 0, 0);                         \
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr[a] + d);                             \
                for (int c = 0; c < MB; c++) acc[a][c] = _mm512_dpbf16_ps(acc[a][c], wv, xv[c]);         \
            }                                                                                            \
        }                                                                                                \
        for (int a = 0; a < nr; a++)                                                                     \
            for (int c = 0; c < mm; c++)                                                                 \
                y[(i + c) * ys + r + a] = to_bf16(_mm512_reduce_add_ps(acc[a][c]) + (b ? from_bf16(b[r + a]) : 0.f)); \
    }
TILE_BF(tile1_bf, 8, 1)
TILE_BF(tile2_bf, 8, 2)
TILE_BF(tile4_bf, 4, 4)
TILE_BF(tile8_bf, 2, 8)

static void linear_rows_bf(const uint16_t *x, int64_t xs, const uint16_t *w, const uint16_t *b, uint16_t *y,
                           int64_t ys, int64_t m, int64_t r0, int64_t r1, int64_t k) {
    if (m == 1) {
        for (int64_t r = r0; r < r1; r += 8) tile1_bf(x, xs, w, b, y, ys, 0, 1, r, r1 - r < 8 ? r1 - r : 8, k, 1);
    } else if (m == 2) {
        for (int64_t r = r0; r < r1; r += 8) tile2_bf(x, xs, w, b, y, ys, 0, 2, r, r1 - r < 8 ? r1 - r : 8, k, 1);
    } else if (m <= 4) {
        for (int64_t r = r0; r < r1; r += 4) tile4_bf(x, xs, w, b, y, ys, 0, m, r, r1 - r < 4 ? r1 - r : 4, k, 1);
    } else {
        for (int64_t r = r0; r < r1; r += 2)
            for (int64_t i = 0; i < m; i += 8) /* the weight rows stay in L1 after the first 8 rows of x */
                tile8_bf(x, xs, w, b, y, ys, i, m - i < 8 ? m - i : 8, r, r1 - r < 2 ? r1 - r : 2, k, i == 0);
    }
}

static void linear_range_bf(const uint16_t *x, int64_t xs, const uint16_t *const *w, const uint16_t *const *b,
                            const int64_t *n, int count, uint16_t *y, int64_t ys, int64_t m, int64_t k, int64_t lo,
                            int64_t hi) {
    int64_t first = 0;
    for (int j = 0; j < count && first < hi; first += n[j], j++) {
        const int64_t r0 = lo > first ? lo - first : 0, r1 = hi - first < n[j] ? hi - first : n[j];
        if (r0 < r1) linear_rows_bf(x, xs, w[j], b[j], y + first, ys, m, r0, r1, k);
    }
}
#endif

/* Thread t of nt's share [lo, hi) of `total` rows: contiguous, whole tiles of 8 where it can. */
static inline void share(int64_t total, int64_t t, int64_t nt, int64_t *lo, int64_t *hi) {
    const int64_t per = ((total + nt - 1) / nt + 7) / 8 * 8;
    *lo = t * per;
    *hi = *lo + per < total ? *lo + per : total;
}

/* Rows [lo, hi) of `count` weights' concatenated rows (biases may be NULL) into y, in either dtype. */
static void any_linear_range(int bf16, const void *x, int64_t xs, const void *const *w, const void *const *b,
                             const int64_t *n, int count, void *y, int64_t ys, int64_t m, int64_t k, int64_t lo,
                             int64_t hi) {
#ifdef DPBF16
    if (bf16) {
        linear_range_bf(x, xs, (const uint16_t *const *)w, (const uint16_t *const *)b, n, count, y, ys, m, k, lo, hi);
        return;
    }
#endif
    (void)bf16;
    linear_range(x, xs, (const float *const *)w, (const float *const *)b, n, count, y, ys, m, k, lo, hi);
}

/* The linear of x through up to MAX_WEIGHTS weights into their own columns of y, in fp32 or bf16.
 * Returns 0, or 1 for what it does not take (K not a multiple of the vector width, more than
 * MAX_WEIGHTS, bf16 without the bf16 instructions). */
int skinny_linear(const void *x, int64_t xs, int count, const void *const *w, const void *const *b, const int64_t *n,
                  void *y, int64_t ys, int64_t m, int64_t k, int bf16, int threads) {
#ifndef DPBF16
    if (bf16) return 1;
#endif
    if (k % (bf16 ? 32 : W) || count < 1 || count > MAX_WEIGHTS) return 1;
    int64_t total = 0;
    for (int j = 0; j < count; j++) total += n[j];
    if (threads <= 1 || total < 256) { /* a small weight costs less than entering an OpenMP region */
        any_linear_range(bf16, x, xs, w, b, n, count, y, ys, m, k, 0, total);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        share(total, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        if (lo < hi) any_linear_range(bf16, x, xs, w, b, n, count, y, ys, m, k, lo, hi);
    }
    return 0;
}

/* ---- A decoder layer's MLP of a few rows in one call (mlp_step) -----------------------------------
 *
 * y = x + down(round(round(silu(g)) * u)) with g, u = round(gate h), round(up h): SwiGLU on the
 * normed input h with the residual add of x after it, rounded where torch rounds in the model's
 * dtype (every op's output in bf16; none in fp32). At a few rows the model's MLP is three linear
 * calls, each ~10 us of Python around its arithmetic and its own OpenMP region, and three small
 * ops (docs/performance.md, "Linears of a few rows"); here one OpenMP region computes gate, up
 * and the activation (threads over the intermediate columns), then down and the add (over the
 * hidden ones), with one barrier between. h, x, y (m, hidden) with row strides hs, xs, ys (y is
 * neither h nor x); gate, up (inter, hidden) and down (hidden, inter) contiguous; all of one dtype;
 * buf m x 3 x inter elements of it. Returns 1 for what it does not take: bf16 without the bf16
 * instructions, hidden or inter not a multiple of the vector width. */
static inline float silu(float g) { return g / (1.f + expf(-g)); }

typedef struct {
    const void *h, *x, *gate, *up, *down;
    void *y, *buf;
    int64_t hs, xs, ys, m, hidden, inter;
    int bf16;
} mlp_t;

/* Rows [lo, hi) of a weight of `rows` rows into out (row stride os), reading in (row stride is). */
static void mlp_linear(const mlp_t *j, const void *in, int64_t is, const void *w, void *out, int64_t os, int64_t rows,
                       int64_t k, int64_t lo, int64_t hi) {
    const int64_t n[1] = {rows};
    const void *ws[1] = {w}, *bs[1] = {NULL};
    any_linear_range(j->bf16, in, is, ws, bs, n, 1, out, os, j->m, k, lo, hi);
}

/* Thread t of nt: its share of gate/up, the activation, down and the residual add. */
static void mlp_part(const mlp_t *j, int64_t t, int64_t nt) {
    const int64_t I = j->inter, E = j->hidden, m = j->m;
    const size_t size = j->bf16 ? 2 : 4;
    char *g = j->buf, *u = g + (size_t)(m * I) * size, *a = u + (size_t)(m * I) * size;
    int64_t lo, hi;
    share(I, t, nt, &lo, &hi);
    if (lo < hi) {
        mlp_linear(j, j->h, j->hs, j->gate, g, I, I, E, lo, hi);
        mlp_linear(j, j->h, j->hs, j->up, u, I, I, E, lo, hi);
    }
    /* The activation a of the thread's own columns of g and u (no barrier before it); every
     * thread's down rows read the whole of a (the barrier after it). */
    for (int64_t r = 0; r < m && lo < hi; r++)
        for (int64_t c = lo; c < hi; c++) {
            if (j->bf16) {
                const float s = from_bf16(to_bf16(silu(from_bf16(((uint16_t *)g)[r * I + c]))));
                ((uint16_t *)a)[r * I + c] = to_bf16(s * from_bf16(((uint16_t *)u)[r * I + c]));
            } else {
                ((float *)a)[r * I + c] = silu(((float *)g)[r * I + c]) * ((float *)u)[r * I + c];
            }
        }
#pragma omp barrier
    share(E, t, nt, &lo, &hi);
    if (lo >= hi) return;
    mlp_linear(j, a, I, j->down, j->y, j->ys, E, I, lo, hi);
    for (int64_t r = 0; r < m; r++) /* the residual: y = round(x + round(down a)) */
        for (int64_t c = lo; c < hi; c++) {
            if (j->bf16) {
                uint16_t *y = (uint16_t *)j->y + r * j->ys + c;
                *y = to_bf16(from_bf16(((const uint16_t *)j->x)[r * j->xs + c]) + from_bf16(*y));
            } else {
                ((float *)j->y)[r * j->ys + c] += ((const float *)j->x)[r * j->xs + c];
            }
        }
}

int mlp_step(const void *h, int64_t hs, const void *x, int64_t xs, const void *gate, const void *up,
             const void *down, void *y, int64_t ys, void *buf, int64_t m, int64_t hidden, int64_t inter, int bf16,
             int threads) {
    const int64_t width = bf16 ? 32 : W;
#ifndef DPBF16
    if (bf16) return 1;
#endif
    if (hidden % width || inter % width) return 1;
    const mlp_t job = {h, x, gate, up, down, y, buf, hs, xs, ys, m, hidden, inter, bf16};
    if (threads <= 1) {
        mlp_part(&job, 0, 1);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    mlp_part(&job, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}

/* ---- A decoder layer's attention block of a few rows in one call (attn_step) -----------------------
 *
 * out = o_proj(attention(q, k, v)) with q, k, v = h Wq^T + bq, h Wk^T + bk, h Wv^T + bv: the
 * projections (threads over the three weights' concatenated rows, into buf), then decode_step's
 * work (RoPE, the cache write, each token's attention: threads over (row, kv head)), then the
 * output projection (threads over its rows), in one OpenMP region: at a few rows these were
 * three calls and a dozen small ops of Python a layer (docs/performance.md, "Linears of a few
 * rows"). Shapes and layout as decode_step's, q, k and v rows of buf; h (B x T, E) with row
 * stride hs, out (B x T, E) contiguous; wq (H x D, E), wk, wv (K x D, E), wo (E, H x D)
 * contiguous, biases NULL or of their weight's rows; buf (B x T) x (2 H + 2 K) x D elements.
 * Returns decode_step's statuses, or 1 for a dtype or width the linears do not take. */
int attn_step(const void *h, int64_t hs, const void *wq, const void *wk, const void *wv, const void *bq,
              const void *bk, const void *bv, const void *wo, const void *cos, const void *sin, const int64_t *pos,
              const int32_t *lens, void *k, void *v, void *out, void *buf, int64_t batch, int64_t tokens,
              int64_t heads, int64_t rows, int64_t dim, int64_t hidden, int64_t slot_stride, int64_t head_stride,
              float scale, int bf16, int threads) {
    const int64_t width = bf16 ? 32 : W, m = batch * tokens, hd = heads * rows * dim, kd = heads * dim;
    const int64_t qkv = hd + 2 * kd, n[3] = {hd, kd, kd};
#ifndef DPBF16
    if (bf16) return 1;
#endif
    if (tokens * rows > MAX_ROWS || dim > MAX_DIM || dim % W || hidden % width || hd % width) return 1;
    const size_t size = bf16 ? 2 : 4;
    char *proj = buf, *att = proj + (size_t)(m * qkv) * size;
    const job_t job = {proj, proj + hd * size, proj + (hd + kd) * size, cos, sin, qkv, qkv, qkv, pos, lens, k, v, att,
                       batch, tokens, heads, rows, dim, slot_stride, head_stride, scale, bf16};
    const void *ws[3] = {wq, wk, wv}, *bs[3] = {bq, bk, bv}, *wos[1] = {wo}, *none[1] = {NULL};
    const int64_t no[1] = {hidden};
    int64_t longest = 1;
    for (int64_t r = 0; r < m; r++)
        if (lens[r] > longest) longest = lens[r];
    const int64_t qrows = tokens * rows;
    int status = 0;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t lo, hi;
        share(qkv, t, nt, &lo, &hi);
        if (lo < hi) any_linear_range(bf16, h, hs, ws, bs, n, 3, proj, qkv, m, hidden, lo, hi);
        float *scratch = malloc(sizeof(float) * (size_t)(qrows * longest + 2 * qrows * dim));
        if (!scratch) {
#pragma omp atomic write
            status = 2;
        }
#pragma omp barrier
#pragma omp for schedule(static, 1)
        for (int64_t w = 0; w < batch * heads; w++)
            if (scratch)
                attend(&job, w / heads, w % heads, scratch, scratch + qrows * longest,
                       scratch + qrows * longest + qrows * dim);
        free(scratch);
        share(hidden, t, nt, &lo, &hi);
        if (lo < hi && !status) any_linear_range(bf16, att, hd, wos, none, no, 1, out, hidden, m, hd, lo, hi);
    }
    return status;
}
