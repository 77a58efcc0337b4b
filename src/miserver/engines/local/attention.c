/*
 * Grouped-query attention of one decode step over a static KV cache, each row over its own length only.
 *
 * Shapes (float32, C order):
 *   q       [rows, heads, head_dim]           the step's rotated queries
 *   keys    [slots, kv_heads, capacity, head_dim]   one layer of the cache, float32 or bfloat16 (values: the same)
 *   slot    [rows]  (int64)                   the cache slot of each row
 *   seen    [rows]  (int64)                   the columns 0 .. seen - 1 each row attends to (1 <= seen <= capacity)
 *   out     [rows, heads, head_dim]           softmax(q k^T * scale) v of each query head
 *   k, v    [rows, kv_heads, head_dim]        (float32, optional; rows k_stride and v_stride floats apart) each
 *                                             row's own key and value, written into column seen - 1 of its slot
 *                                             before any row attends (into a bfloat16 cache rounded to nearest,
 *                                             ties to even, as torch converts)
 *
 * Query head h reads kv head h / (heads / kv_heads), as transformers' repeat_kv. One task is one (row, kv head)
 * pair: it loads each of that pair's key and value columns once for the whole query group, in column order, and
 * nothing of any other row, so a row's result never depends on the other rows of the step, nor on how tasks are
 * spread over threads. head_dim must be a multiple of 16 and at most 256, and heads a multiple of kv_heads (the
 * caller checks).
 *
 * Order of operations, per query head: each score is its column's lane-wise products (q chunk by chunk, added in
 * chunk order) summed by sum16, times scale; the softmax below; each output lane is the sum over columns, in column
 * order, of weight times value, times 1 / (the weights' sum16).
 *
 * Vectors are GCC's vector extensions (16 floats), which the compiler lowers to the machine's own (AVX-512, AVX2,
 * SSE or NEON). The exponential is Cephes' expf polynomial (range reduction by log 2, degree-5 polynomial, exponent
 * bits), as in llama.cpp's and other CPU engines' softmax: within 2 ulp of expf.
 */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define LANES 16
#define MAX_CHUNKS 16 /* head_dim up to 256 */

/* 16 floats, loaded and stored at any float alignment and through any float pointer (the compiler lowers it to
   the machine's vectors) */
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t i16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t h16 __attribute__((vector_size(32), aligned(2), may_alias));

static inline __attribute__((always_inline)) v16 load(const void *base, int64_t at, const int bf16) {
    /* 16 cache elements from element ``at``, as floats (a bfloat16 is a float's upper 16 bits) */
    if (bf16) return (v16)(__builtin_convertvector(*(const h16 *)((const uint16_t *)base + at), i16) << 16);
    return *(const v16 *)((const float *)base + at);
}

static inline float sum16(v16 x) {
    /* fixed order: halves added pairwise, four times */
    v16 a = x + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    a = a + __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    a = a + __builtin_shufflevector(a, a, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    a = a + __builtin_shufflevector(a, a, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
    return a[0];
}

static inline float max16(v16 x) {
    float top = x[0];
    for (int l = 1; l < LANES; l++) top = x[l] > top ? x[l] : top;
    return top;
}

static inline v16 exp_neg(v16 x) {
    /* e^x for x <= 0 (a score minus its row's maximum); under -87 it is 2^-126 or less, taken as e^-87 */
    const v16 floor_ = (v16){0} - 87.0f;
    i16 low = x < floor_;
    x = (v16)(((i16)x & ~low) | ((i16)floor_ & low));
    i16 ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i16); /* round(x / ln 2) for x <= 0 */
    v16 n = __builtin_convertvector(ni, v16);
    v16 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    v16 y = (v16){0} + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    return y * (v16)((ni + 127) << 23);
}

static inline __attribute__((always_inline)) void sums16(const v16 *a, float *out, float scale) {
    /* out[l] = sum16(a[l]) * scale for l = 0 .. 15, every sum in sum16's order: four rounds, each adding the lanes
       sum16 adds, of two vectors at a time (lanes of one column stay together, columns in order) */
    v16 b[8], c[4], d[2];
    for (int m = 0; m < 8; m++)
        b[m] = __builtin_shufflevector(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * m], a[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                       31);
    for (int m = 0; m < 4; m++)
        c[m] = __builtin_shufflevector(b[2 * m], b[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                       27) +
               __builtin_shufflevector(b[2 * m], b[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int m = 0; m < 2; m++)
        d[m] = __builtin_shufflevector(c[2 * m], c[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                       29) +
               __builtin_shufflevector(c[2 * m], c[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    v16 e = __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
            __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    *(v16 *)out = e * scale;
}

static inline __attribute__((always_inline)) void attend_one(const float *q, const void *k, const void *v,
                                                            float *out, const int64_t group, const int64_t head_dim,
                                                            int64_t seen, float scale, float *scores,
                                                            const int bf16) {
    /* q [group, head_dim], k and v [seen, head_dim], out [group, head_dim]; scores [group, padded] with padded
       seen rounded up to 16. Each key and value column is loaded once for the whole group; with a constant group
       and head_dim (see the caller) the group's queries and output sums stay in registers. */
    const int64_t chunks = head_dim / LANES;
    const int64_t padded = (seen + LANES - 1) / LANES * LANES;
    v16 qv[MAX_GROUP][MAX_CHUNKS];
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) qv[g][c] = *(const v16 *)(q + g * head_dim + c * LANES);
    /* scores, 16 columns at a time: each column's lane-wise products, then the 16 sums at once */
    for (int64_t j0 = 0; j0 < seen; j0 += LANES) {
        const int64_t n = seen - j0 < LANES ? seen - j0 : LANES;
        v16 acc[MAX_GROUP][LANES];
        for (int64_t l = 0; l < n; l++) {
            v16 kj[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; c++) kj[c] = load(k, (j0 + l) * head_dim + c * LANES, bf16);
            for (int64_t g = 0; g < group; g++) {
                v16 a = qv[g][0] * kj[0];
                for (int64_t c = 1; c < chunks; c++) a += qv[g][c] * kj[c];
                acc[g][l] = a;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            for (int64_t l = n; l < LANES; l++) acc[g][l] = (v16){0};
            sums16(acc[g], scores + g * padded + j0, scale);
        }
    }
    float inv[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * padded;
        for (int64_t j = seen; j < padded; j++) s[j] = s[0]; /* the padding: cleared after the exponential */
        v16 top = *(v16 *)s;
        for (int64_t j = LANES; j < padded; j += LANES) {
            v16 x = *(v16 *)(s + j);
            top = (v16)(((i16)x & (x > top)) | ((i16)top & ~(x > top)));
        }
        const float m = max16(top);
        v16 total = (v16){0};
        for (int64_t j = 0; j < padded; j += LANES) {
            v16 p = exp_neg(*(v16 *)(s + j) - m);
            if (j + LANES > seen)
                for (int64_t l = seen - j; l < LANES; l++) p[l] = 0.0f;
            *(v16 *)(s + j) = p;
            total += p;
        }
        inv[g] = 1.0f / sum16(total);
    }
    /* the weighted values: each value column loaded once, added into every head's sums in column order */
    v16 o[MAX_GROUP][MAX_CHUNKS];
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) o[g][c] = (v16){0};
    for (int64_t j = 0; j < seen; j++) {
        v16 vj[MAX_CHUNKS];
        for (int64_t c = 0; c < chunks; c++) vj[c] = load(v, j * head_dim + c * LANES, bf16);
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * padded + j];
            for (int64_t c = 0; c < chunks; c++) o[g][c] += p * vj[c];
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) *(v16 *)(out + g * head_dim + c * LANES) = o[g][c] * inv[g];
}

#define ATTEND(G, D)                                                                                           \
    do {                                                                                                       \
        if (bf16)                                                                                              \
            attend_one(q + at, k, v, o, (G), (D), seen[row], scale, scores, 1);                                \
        else                                                                                                   \
            attend_one(q + at, k, v, o, (G), (D), seen[row], scale, scores, 0);                                \
    } while (0)

static inline uint16_t to_bfloat16(const float x) {
    /* x rounded to the nearest bfloat16, ties to even (torch's conversion); a NaN gives a NaN */
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (x != x) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline void write_column(const float *from, void *cache, const int64_t at, const int64_t head_dim,
                                const int bf16) {
    /* head_dim floats into the cache from element at */
    if (bf16)
        for (int64_t i = 0; i < head_dim; i++) ((uint16_t *)cache)[at + i] = to_bfloat16(from[i]);
    else
        memcpy((float *)cache + at, from, (size_t)head_dim * sizeof(float));
}

int miserver_decode_attention(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                              const int64_t *slot, const int64_t *seen, float *out, int64_t k_stride,
                              int64_t v_stride, int64_t rows, int64_t heads, int64_t kv_heads, int64_t capacity,
                              int64_t head_dim, float scale, int threads, int bf16) {
    /* 0 on success; 1 when scratch memory could not be had, 2 for a query group over MAX_GROUP or a head_dim over
       LANES * MAX_CHUNKS (out undefined, nothing written); k_new and v_new NULL: nothing is written, else row r's
       kv head h starts at element r * k_stride + h * head_dim of k_new (v_stride: of v_new) */
    const int64_t group = heads / kv_heads;
    const int64_t tasks = rows * kv_heads;
    const size_t element = bf16 ? 2 : 4;
    int failed = 0;
    if (group > MAX_GROUP || head_dim > LANES * MAX_CHUNKS) return 2;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        if (k_new != NULL && v_new != NULL) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) { /* every column is written before any row attends (the barrier) */
                const int64_t row = t / kv_heads, h = t % kv_heads;
                const int64_t at = ((slot[row] * kv_heads + h) * capacity + seen[row] - 1) * head_dim;
                write_column(k_new + row * k_stride + h * head_dim, keys, at, head_dim, bf16);
                write_column(v_new + row * v_stride + h * head_dim, values, at, head_dim, bf16);
            }
        }
        float *scores = malloc((size_t)(group * (capacity + LANES)) * sizeof(float));
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (scores == NULL) continue;
            const int64_t row = t / kv_heads, h = t % kv_heads;
            const size_t base = (size_t)((slot[row] * kv_heads + h) * capacity * head_dim) * element;
            const char *k = (const char *)keys + base, *v = (const char *)values + base;
            const int64_t at = (row * heads + h * group) * head_dim;
            float *o = out + at;
            /* constant element type, and for head_dim 64 a constant group too, so that their loops unroll */
            if (head_dim == 64 && group == 1)
                ATTEND(1, 64);
            else if (head_dim == 64 && group == 2)
                ATTEND(2, 64);
            else if (head_dim == 64 && group == 3)
                ATTEND(3, 64);
            else if (head_dim == 64 && group == 4)
                ATTEND(4, 64);
            else
                ATTEND(group, head_dim);
        }
        free(scores);
    }
    return failed;
}
