/* Decode attention over a slotted KV cache: every query row of a sequence attends its own first
 * L keys, read where they lie in the cache, bf16 or fp32, with fp32 scores and sums.
 *
 * Built by tailrl/attention_kernel.py with the machine's C compiler for the machine's own
 * instruction set; see that module for why it exists and how it is checked.
 *
 * Layout (tailrl.model.KVCache): keys and values of one layer are (C, K, M, D) with unit stride
 * along D; `slot_stride` and `head_stride` are the element strides of C and K (equal for keys
 * and values). q and out are (B, K, n, D) contiguous, in the cache's dtype: the n query rows of a
 * kv head (its G query heads x T tokens) share that head's keys. Work is split over threads by
 * (row, kv head).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 64  /* query rows per kv head: the caller checks n <= MAX_ROWS */
#define MAX_DIM 256  /* head dim: the caller checks D <= MAX_DIM */

typedef struct {
    const void *q, *k, *v;
    const int32_t *lens;
    void *out;
    int64_t batch, heads, rows, dim, slot_stride, head_stride;
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

/* One (row b, kv head h): scores of its n query rows over the row's L keys, softmax, values.
 * `scores` holds n x L floats, `q` and `acc` n x D. */
static void attend(const job_t *j, int64_t b, int64_t h, float *scores, float *q, float *acc) {
    const int64_t D = j->dim, n = j->rows, L = j->lens[b], first = (b * j->heads + h) * n * D;
    const int64_t base = b * j->slot_stride + h * j->head_stride;
    float row[MAX_DIM], top[MAX_ROWS], total[MAX_ROWS];
    load(j->bf16, j->q, first, n * D, q);
    for (int64_t i = 0; i < n * D; i++) q[i] *= j->scale;
    for (int64_t i = 0; i < n; i++) top[i] = -FLT_MAX;
    for (int64_t s = 0; s < L; s++) {
        load(j->bf16, j->k, base + s * D, D, row);
        for (int64_t i = 0; i < n; i++) {
            const float *qi = q + i * D;
            float dot = 0.f;
            for (int64_t d = 0; d < D; d++) dot += qi[d] * row[d];
            scores[i * L + s] = dot;
            top[i] = dot > top[i] ? dot : top[i];
        }
    }
    for (int64_t i = 0; i < n; i++) {
        float *sc = scores + i * L, sum = 0.f;
        for (int64_t s = 0; s < L; s++) {
            sc[s] = expf(sc[s] - top[i]);
            sum += sc[s];
        }
        total[i] = sum;
    }
    memset(acc, 0, (size_t)(n * D) * sizeof(float));
    for (int64_t s = 0; s < L; s++) {
        load(j->bf16, j->v, base + s * D, D, row);
        for (int64_t i = 0; i < n; i++) {
            const float p = scores[i * L + s];
            float *a = acc + i * D;
            for (int64_t d = 0; d < D; d++) a[d] += p * row[d];
        }
    }
    for (int64_t i = 0; i < n; i++) {
        const float r = 1.f / total[i];
        for (int64_t d = 0; d < D; d++) {
            const float o = acc[i * D + d] * r;
            if (j->bf16)
                ((uint16_t *)j->out)[first + i * D + d] = to_bf16(o);
            else
                ((float *)j->out)[first + i * D + d] = o;
        }
    }
}

/* Returns 0 on success; 1 for shapes past the fixed limits, 2 when a thread could not have its
 * buffers (the caller then fails loudly). OpenMP: linked against the libgomp the process already
 * has (torch's), so this runs on torch's own worker threads rather than on threads of its own
 * that would compete with them for the cores. */
int decode_attention(const void *q, const void *k, const void *v, const int32_t *lens, void *out, int64_t batch,
                     int64_t heads, int64_t rows, int64_t dim, int64_t slot_stride, int64_t head_stride, float scale,
                     int bf16, int threads) {
    if (rows > MAX_ROWS || dim > MAX_DIM) return 1;
    const job_t job = {q, k, v, lens, out, batch, heads, rows, dim, slot_stride, head_stride, scale, bf16};
    int64_t longest = 1;
    for (int64_t b = 0; b < batch; b++)
        if (lens[b] > longest) longest = lens[b];
    int status = 0;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads)
    {
        float *buf = malloc(sizeof(float) * (size_t)(rows * longest + 2 * rows * dim));
        if (!buf) {
#pragma omp atomic write
            status = 2;
        }
#pragma omp for schedule(static, 1)
        for (int64_t w = 0; w < batch * heads; w++)
            if (buf) attend(&job, w / heads, w % heads, buf, buf + rows * longest, buf + rows * longest + rows * dim);
        free(buf);
    }
    return status;
}
