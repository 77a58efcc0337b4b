/*
 * Products of float32 rows with a matrix held in the bits of a GGUF quantized tensor: groups of 32 inputs of one
 * output share a scale d (and, 4-bit, a minimum m).
 *
 *   8-bit (GGUF's Q8_0): weight = d * q, q an int8.
 *   4-bit (GGUF's Q4_1): weight = d * q + m, q from 0 to 15, two to a byte: byte j of a group's 16 holds q[j] in
 *                        its low four bits and q[j + 16] in its high four.
 *
 * Shapes (C order):
 *   x       [rows, in]          float32, the inputs
 *   q       [out, in]           int8 (8-bit), or [out, in / 2] uint8 (4-bit)
 *   d, m    [out, in / 32]      float32, each group's scale and minimum
 *   y       [rows, out]         float32, y[r, o] = sum over i of x[r, i] * weight[o, i]
 *
 * 8-bit, per row and output: four 8-lane sums, sum k over inputs 8k .. 8k + 7 of each group, each lane adding
 * x * (d * q) group by group; then (sum 0 + sum 1) + (sum 2 + sum 3) lane by lane and the lanes by sum8: the float32
 * product up to the rounding of its additions.
 *
 * 4-bit, where the compiler targets AVX2: as llama.cpp multiplies a Q4_1 matrix, each row's inputs are first
 * quantized per group of 32 to int8 (scale dx = the group's largest magnitude / 127, x8 = x / dx rounded to
 * nearest, ties to even), and each group's products are integer: s = sum of q * x8 (exact, in int32, eight partial
 * sums of four products). Per row and output, one 8-lane float sum adds s * (d * dx) group by group (fused
 * multiply-adds where the processor has FMA); the result is its sum8 plus the minimums' part, the sum over groups
 * of m * (dx * the sum of the group's x8): eight lanes, lane l adding groups l, l + 8, ... in order, summed by sum8,
 * then the groups past the last multiple of eight in order. The
 * inputs' rounding to 8 bits (at most dx / 2 an input) is the only difference from the float32 product beyond the
 * additions' rounding: about what rounding the inputs to bfloat16 costs. Elsewhere 4-bit goes as 8-bit does, each
 * weight being d * q + m.
 *
 * A row's result never depends on the other rows of the product (every row goes through the same operations, a
 * few rows at a time), nor on how outputs are spread over threads.
 *
 * Vectors are GCC's vector extensions (8 floats, the width of AVX2, which the compiler lowers well), with the
 * widening of bytes to floats spelt out for x86 (GCC lowers a conversion of byte vectors lane by lane). ``in`` must
 * be a multiple of 32.
 */

#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define GROUP 32
#define LANES 8
#define ROW_BLOCK 2
#define ROW_BLOCK4 4 /* rows at a time of the AVX2 4-bit product */

typedef float v8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef int8_t b8 __attribute__((vector_size(8), aligned(1), may_alias));
typedef int32_t i8 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8 widen(const int8_t *at) {
    /* 8 int8 as floats */
#if defined(__AVX2__)
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)at)));
#else
    return __builtin_convertvector(__builtin_convertvector(*(const b8 *)at, i8), v8);
#endif
}

static inline __attribute__((always_inline)) void nibbles(const uint8_t *at, v8 w[4]) {
    /* a 4-bit group's 32 q (16 bytes) as floats: w[0], w[1] the low halves of bytes 0-7, 8-15; w[2], w[3] the high */
#if defined(__AVX2__)
    const __m128i b = _mm_loadu_si128((const __m128i *)at);
    const __m128i low = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    w[0] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
    w[1] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
    w[2] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
    w[3] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
#else
    for (int l = 0; l < LANES; l++) {
        w[0][l] = (float)(at[l] & 15);
        w[1][l] = (float)(at[l + 8] & 15);
        w[2][l] = (float)(at[l] >> 4);
        w[3][l] = (float)(at[l + 8] >> 4);
    }
#endif
}

static inline float sum8(v8 x) {
    /* fixed order: halves added pairwise, three times */
    v8 a = x + __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
    a = a + __builtin_shufflevector(a, a, 2, 3, 0, 1, 2, 3, 0, 1);
    a = a + __builtin_shufflevector(a, a, 1, 0, 1, 0, 1, 0, 1, 0);
    return a[0];
}

static inline __attribute__((always_inline)) void output_rows(const float *x, const void *q, const float *d,
                                                             const float *m, const float *sums, float *y,
                                                             const int n, const int64_t in, const int64_t out,
                                                             const int four) {
    /* y[r * out] for rows r = 0 .. n - 1 of x (n at most ROW_BLOCK; n and four constants where inlined) over one
       output's q, d and m [in / GROUP]; sums [n, in / GROUP] are the rows' group sums (4-bit) */
    const int64_t groups = in / GROUP;
    v8 acc[ROW_BLOCK][4];
    float low[ROW_BLOCK];
    for (int r = 0; r < n; r++) {
        low[r] = 0.0f;
        for (int k = 0; k < 4; k++) acc[r][k] = (v8){0};
    }
    for (int64_t g = 0; g < groups; g++) {
        const float scale = d[g];
        v8 w[4];
        if (four)
            nibbles((const uint8_t *)q + g * (GROUP / 2), w);
        else
            for (int k = 0; k < 4; k++) w[k] = widen((const int8_t *)q + g * GROUP + k * LANES);
        for (int k = 0; k < 4; k++) w[k] = w[k] * scale;
        for (int r = 0; r < n; r++) {
            for (int k = 0; k < 4; k++) acc[r][k] += *(const v8 *)(x + r * in + g * GROUP + k * LANES) * w[k];
            if (four) low[r] += m[g] * sums[r * groups + g];
        }
    }
    for (int r = 0; r < n; r++) y[r * out] = sum8((acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3])) + low[r];
}

#if defined(__AVX2__)
static inline __attribute__((always_inline)) __m256 multiply_add(__m256 a, __m256 b, __m256 c) {
    /* a * b + c, fused where the processor has FMA */
#if defined(__FMA__)
    return _mm256_fmadd_ps(a, b, c);
#else
    return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}

static inline __attribute__((always_inline)) void int4_output_rows(const int8_t *xq, const float *xd,
                                                                  const float *sums, const uint8_t *q, const float *d,
                                                                  const float *m, float *y, const int n,
                                                                  const int64_t groups, const int64_t out) {
    /* y[r * out] for rows r = 0 .. n - 1 (n at most ROW_BLOCK4, a constant where inlined) of the quantized inputs
       xq [n, groups * GROUP] with scales xd and sums (dx * the sum of x8) [n, groups], over one output's packed q,
       d and m */
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_BLOCK4];
    float low[ROW_BLOCK4];
    for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(q + g * (GROUP / 2)));
        const __m256i w =
            _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1), mask);
        const __m256 dv = _mm256_set1_ps(d[g]);
        for (int r = 0; r < n; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (r * groups + g) * GROUP));
            const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones));
            acc[r] = multiply_add(s, _mm256_mul_ps(dv, _mm256_broadcast_ss(xd + r * groups + g)), acc[r]);
        }
    }
    for (int r = 0; r < n; r++) {
        /* the minimums' part: lane l adds m * sums of groups l, l + 8, ... in order; then the groups left over */
        __m256 part = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + LANES <= groups; g += LANES)
            part = multiply_add(_mm256_loadu_ps(m + g), _mm256_loadu_ps(sums + r * groups + g), part);
        low[r] = sum8((v8)part);
        for (; g < groups; g++) low[r] += m[g] * sums[r * groups + g];
    }
    for (int r = 0; r < n; r++) y[r * out] = sum8((v8)acc[r]) + low[r];
}

static int int4_integer(const float *x, const uint8_t *q, const float *d, const float *m, float *y, int64_t rows,
                        int64_t in, int64_t out, int threads) {
    /* the AVX2 4-bit product (see the top); as product() */
    const int64_t groups = in / GROUP;
    int8_t *xq = malloc((size_t)(rows * in));
    float *xd = malloc((size_t)(rows * groups) * sizeof(float)), *sums = malloc((size_t)(rows * groups) * sizeof(float));
    if (xq == NULL || xd == NULL || sums == NULL) {
        free(xq), free(xd), free(sums);
        return 1;
    }
    for (int64_t r = 0; r < rows * groups; r++) {
        const float *xg = x + r * GROUP;
        float top = 0.0f;
        for (int i = 0; i < GROUP; i++) {
            const float a = xg[i] < 0 ? -xg[i] : xg[i];
            top = a > top ? a : top;
        }
        const float scale = top / 127.0f;
        int32_t total = 0;
        for (int i = 0; i < GROUP; i++) {
            const int8_t v = (int8_t)(scale > 0 ? __builtin_rintf(xg[i] / scale) : 0.0f);
            xq[r * GROUP + i] = v;
            total += v;
        }
        xd[r] = scale;
        sums[r] = scale * (float)total;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const uint8_t *qo = q + o * (in / 2);
        const float *dout = d + o * groups, *mout = m + o * groups;
        int64_t r = 0;
        for (; r + ROW_BLOCK4 <= rows; r += ROW_BLOCK4)
            int4_output_rows(xq + r * in, xd + r * groups, sums + r * groups, qo, dout, mout, y + r * out + o,
                             ROW_BLOCK4, groups, out);
        switch (rows - r) {
        case 1: int4_output_rows(xq + r * in, xd + r * groups, sums + r * groups, qo, dout, mout, y + r * out + o, 1, groups, out); break;
        case 2: int4_output_rows(xq + r * in, xd + r * groups, sums + r * groups, qo, dout, mout, y + r * out + o, 2, groups, out); break;
        case 3: int4_output_rows(xq + r * in, xd + r * groups, sums + r * groups, qo, dout, mout, y + r * out + o, 3, groups, out); break;
        default: break;
        }
    }
    free(xq), free(xd), free(sums);
    return 0;
}
#endif

static int product(const float *x, const void *q, const float *d, const float *m, float *y, int64_t rows,
                   int64_t in, int64_t out, int threads, const int four) {
    /* 0 on success; 1 when scratch memory could not be had; 2 when in is not a multiple of GROUP (y untouched) */
    if (in % GROUP) return 2;
    const int64_t groups = in / GROUP;
    const int64_t row_bytes = four ? in / 2 : in;
    float *sums = NULL;
    if (four) {
        sums = malloc((size_t)(rows * groups) * sizeof(float));
        if (sums == NULL) return 1;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t g = 0; g < groups; g++) {
                float s = 0.0f;
                for (int64_t i = 0; i < GROUP; i++) s += x[r * in + g * GROUP + i];
                sums[r * groups + g] = s;
            }
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const char *qo = (const char *)q + o * row_bytes;
        const float *dout = d + o * groups, *mout = four ? m + o * groups : NULL;
        int64_t r = 0;
        for (; r + ROW_BLOCK <= rows; r += ROW_BLOCK) {
            const float *s = four ? sums + r * groups : NULL;
            if (four)
                output_rows(x + r * in, qo, dout, mout, s, y + r * out + o, ROW_BLOCK, in, out, 1);
            else
                output_rows(x + r * in, qo, dout, mout, s, y + r * out + o, ROW_BLOCK, in, out, 0);
        }
        if (r < rows) {
            const float *s = four ? sums + r * groups : NULL;
            if (four)
                output_rows(x + r * in, qo, dout, mout, s, y + r * out + o, 1, in, out, 1);
            else
                output_rows(x + r * in, qo, dout, mout, s, y + r * out + o, 1, in, out, 0);
        }
    }
    free(sums);
    return 0;
}

int miserver_int8_product(const float *x, const int8_t *q, const float *d, float *y, int64_t rows, int64_t in,
                          int64_t out, int threads) {
    return product(x, q, d, NULL, y, rows, in, out, threads, 0);
}

int miserver_int4_product(const float *x, const uint8_t *q, const float *d, const float *m, float *y, int64_t rows,
                          int64_t in, int64_t out, int threads) {
#if defined(__AVX2__)
    if (in % GROUP) return 2;
    return int4_integer(x, q, d, m, y, rows, in, out, threads);
#else
    return product(x, q, d, m, y, rows, in, out, threads, 1);
#endif
}
