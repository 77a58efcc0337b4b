/*
 * Products of float32 rows with a matrix held in the bits of a GGUF quantized tensor, as llama.cpp multiplies them:
 * groups of 32 inputs of one output share a scale d (and, 4-bit, a minimum m).
 *
 *   4-bit (GGUF's Q4_1): weight = d * q + m, q from 0 to 15.
 *   8-bit (GGUF's Q8_0): weight = d * q, q an int8 from -127 to 127.
 *
 * Shapes (C order): x [rows, in] float32, the inputs; y [rows, out] float32, y[r, o] = the sum over i of x[r, i] *
 * weight[o, i]. The outputs come in tiles of 16 (the last one padded with zero weights), and a tile's weights are
 * laid out group by group for products of 16 outputs at once:
 *
 *   4-bit q [tiles, groups, 4, 16, 4]   uint8: byte [t, g, b, o, i] holds, of output 16 t + o and group g, q of
 *                                       input 4 b + i in its low four bits and q of input 16 + 4 b + i in its high four
 *   8-bit q [tiles, groups, 8, 16, 4]   int8: [t, g, k, o, i] is q of output 16 t + o at input 4 k + i of group g
 *   d, m    [tiles, groups, 16]         float32, the scale and minimum of output 16 t + o in group g
 *   c       [tiles, groups, 16]         int32 (8-bit), 128 times the sum of the group's q
 *
 * Each row's inputs are first quantized per group of 32 to int8: scale dx = the group's largest magnitude / 127,
 * x8 = x / dx rounded to nearest (ties to even), sx = dx * the sum of the group's x8. A group's product with one
 * output is then an integer, S = the sum of its 32 q * x8 (exact in int32), and per row and output
 *
 *   4-bit: y = a + b,  a = fma(S, d * dx, a) and b = fma(m, sx, b) over the groups in order, from 0;
 *   8-bit: y = a,      a = fma(S, d * dx, a) over the groups in order, from 0,
 *
 * where fma rounds once. Every path computes exactly this: with AVX-512 VNNI 16 outputs at a time (vpdpbusd; 8-bit,
 * as the sum of (x8 + 128) * q less c), with AVX2 and FMA 8 at a time (vpmaddubsw, vpmaddwd), elsewhere one at a
 * time (fmaf). So a row's result has the same bits on every processor and never depends on the other rows of the
 * product, nor on how tiles are spread over threads. The inputs' rounding to 8 bits (at most dx / 2 an input) is the
 * only difference from the float32 product beyond the additions' rounding: about what rounding the inputs to
 * bfloat16 costs (llama.cpp's method; it also rounds dx to float16, which this kernel does not). A group holding a
 * NaN or an infinity makes its row's results NaN. ``in`` must be a multiple of 32.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define GROUP 32
#define TILE 16      /* outputs of a tile */
#define ROW_BLOCK4 4 /* rows at a time */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#define MADD 1
#endif

static void quantize_inputs(const float *x, int8_t *xq, float *xd, float *sx, const int64_t count, const int threads) {
    /* x's groups (count of them, GROUP floats each) to int8: xq, the scales xd and sx = dx * the sum of x8. A group
       holding a NaN or an infinity gets x8 = 0 and a scale that is not finite, so its products are NaN, as float32's
       would be; x8 is clamped to -127 .. 127 (a group of tiny subnormals can round past it). Groups are spread over
       the threads once there are enough of them to pay for it (a prefill's); each loop below vectorizes */
#pragma omp parallel for num_threads(threads) schedule(static) if (count >= 1024)
    for (int64_t c = 0; c < count; c++) {
        const float *xg = x + c * GROUP;
        int8_t *q = xq + c * GROUP;
        float top = 0.0f;
        int nan = 0;
        for (int i = 0; i < GROUP; i++) {
            const float a = fabsf(xg[i]);
            top = a > top ? a : top;
            nan |= xg[i] != xg[i];
        }
        const float scale = top / 127.0f;
        if (nan || !(scale > 0.0f && scale <= FLT_MAX)) { /* NaN, infinite or all zero */
            memset(q, 0, GROUP);
            xd[c] = nan ? NAN : scale;
            sx[c] = xd[c] * 0.0f;
            continue;
        }
        int32_t total = 0;
        for (int i = 0; i < GROUP; i++) {
            float v = rintf(xg[i] / scale);
            v = v > 127.0f ? 127.0f : v;
            v = v < -127.0f ? -127.0f : v;
            q[i] = (int8_t)v;
            total += (int32_t)v;
        }
        xd[c] = scale;
        sx[c] = scale * (float)total;
    }
}

typedef struct {
    int8_t *q;    /* [rows, in], x8 */
    float *d, *s; /* [rows, groups], dx and sx */
} Inputs;

static int inputs(const float *x, const int64_t rows, const int64_t in, const int threads, Inputs *xs) {
    /* x [rows, in] quantized into scratch (release() frees it); 1 when memory could not be had (nothing held) */
    const int64_t groups = in / GROUP;
    xs->q = malloc((size_t)(rows * in));
    xs->d = malloc((size_t)(rows * groups) * sizeof(float));
    xs->s = malloc((size_t)(rows * groups) * sizeof(float));
    if (xs->q == NULL || xs->d == NULL || xs->s == NULL) {
        free(xs->q), free(xs->d), free(xs->s);
        return 1;
    }
    quantize_inputs(x, xs->q, xs->d, xs->s, rows * groups, threads);
    return 0;
}

static void release(Inputs *xs) { free(xs->q), free(xs->d), free(xs->s); }

static inline int32_t chunk(const int8_t *at) {
    /* 4 int8 as one int32 (for broadcasting) */
    int32_t v;
    memcpy(&v, at, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void tile_rows(const int8_t *xq, const float *xd, const float *sx,
                                                           const uint8_t *q, const float *d, const float *m,
                                                           float *y, const int n, const int64_t groups,
                                                           const int64_t out, const int64_t first) {
    /* y[r * out + first + o] for rows r = 0 .. n - 1 (n at most ROW_BLOCK4, a constant where inlined) of the
       quantized inputs xq [n, groups * GROUP] with xd and sx [n, groups], and the outputs o of one tile (its q, d,
       m as laid out at the top) below out - first */
    const int64_t in = groups * GROUP;
#if defined(VNNI)
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 a[ROW_BLOCK4], b[ROW_BLOCK4];
    for (int r = 0; r < n; r++) a[r] = b[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i w[8];
        for (int k = 0; k < 4; k++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(q + (g * 4 + k) * 64));
            w[k] = _mm512_and_si512(raw, mask);
            w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
        }
        const __m512 dv = _mm512_loadu_ps(d + g * TILE), mv = _mm512_loadu_ps(m + g * TILE);
        for (int r = 0; r < n; r++) {
            const int8_t *xg = xq + r * in + g * GROUP;
            __m512i s = _mm512_setzero_si512();
            for (int k = 0; k < 8; k++) s = _mm512_dpbusd_epi32(s, w[k], _mm512_set1_epi32(chunk(xg + 4 * k)));
            const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(xd[r * groups + g]));
            a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, a[r]);
            b[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[r * groups + g]), b[r]);
        }
    }
    const int64_t left = out - first;
    const __mmask16 keep = left >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    for (int r = 0; r < n; r++) _mm512_mask_storeu_ps(y + r * out + first, keep, _mm512_add_ps(a[r], b[r]));
#elif defined(MADD)
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) { /* outputs 8 h .. 8 h + 7 of the tile: bytes 32 h .. 32 h + 31 of each 64 */
        __m256 a[ROW_BLOCK4], b[ROW_BLOCK4];
        for (int r = 0; r < n; r++) a[r] = b[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256i w[8];
            for (int k = 0; k < 4; k++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + (g * 4 + k) * 64 + h * 32));
                w[k] = _mm256_and_si256(raw, mask);
                w[k + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            }
            const __m256 dv = _mm256_loadu_ps(d + g * TILE + h * 8), mv = _mm256_loadu_ps(m + g * TILE + h * 8);
            for (int r = 0; r < n; r++) {
                const int8_t *xg = xq + r * in + g * GROUP;
                /* pairs of products summed in int16: at most 8 * 2 * 15 * 127 = 30480 a lane, no saturation */
                __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(chunk(xg)));
                for (int k = 1; k < 8; k++)
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[k], _mm256_set1_epi32(chunk(xg + 4 * k))));
                const __m256i s = _mm256_madd_epi16(s16, ones);
                const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(xd[r * groups + g]));
                a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, a[r]);
                b[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sx[r * groups + g]), b[r]);
            }
        }
        for (int r = 0; r < n; r++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, _mm256_add_ps(a[r], b[r]));
            for (int o = 0; o < 8 && first + h * 8 + o < out; o++) y[r * out + first + h * 8 + o] = lanes[o];
        }
    }
#else
    for (int r = 0; r < n; r++)
        for (int o = 0; o < TILE && first + o < out; o++) {
            float a = 0.0f, b = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const int8_t *xg = xq + r * in + g * GROUP;
                int32_t s = 0;
                for (int k = 0; k < 4; k++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = q[((g * 4 + k) * TILE + o) * 4 + i];
                        s += (byte & 15) * xg[4 * k + i] + (byte >> 4) * xg[16 + 4 * k + i];
                    }
                a = fmaf((float)s, d[g * TILE + o] * xd[r * groups + g], a);
                b = fmaf(m[g * TILE + o], sx[r * groups + g], b);
            }
            y[r * out + first + o] = a + b;
        }
#endif
}

static inline __attribute__((always_inline)) void tile_rows8(const int8_t *xq, const float *xd, const int8_t *q,
                                                            const float *d, const int32_t *c, float *y, const int n,
                                                            const int64_t groups, const int64_t out,
                                                            const int64_t first) {
    /* as tile_rows, over one tile of an 8-bit matrix (q, d and c as laid out at the top) */
    const int64_t in = groups * GROUP;
#if defined(VNNI)
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 a[ROW_BLOCK4];
    for (int r = 0; r < n; r++) a[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i w[8];
        for (int k = 0; k < 8; k++) w[k] = _mm512_loadu_si512((const void *)(q + (g * 8 + k) * 64));
        const __m512 dv = _mm512_loadu_ps(d + g * TILE);
        const __m512i cv = _mm512_loadu_si512((const void *)(c + g * TILE));
        for (int r = 0; r < n; r++) {
            const int8_t *xg = xq + r * in + g * GROUP;
            /* x8 + 128 as unsigned bytes times q, less 128 times the sum of q */
            __m512i s = _mm512_setzero_si512();
            for (int k = 0; k < 8; k++)
                s = _mm512_dpbusd_epi32(s, _mm512_xor_si512(_mm512_set1_epi32(chunk(xg + 4 * k)), flip), w[k]);
            const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(xd[r * groups + g]));
            a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s, cv)), scale, a[r]);
        }
    }
    const int64_t left = out - first;
    const __mmask16 keep = left >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    for (int r = 0; r < n; r++) _mm512_mask_storeu_ps(y + r * out + first, keep, a[r]);
#elif defined(MADD)
    (void)c;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) { /* outputs 8 h .. 8 h + 7 of the tile: bytes 32 h .. 32 h + 31 of each 64 */
        __m256 a[ROW_BLOCK4];
        for (int r = 0; r < n; r++) a[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256i w[8], size[8];
            for (int k = 0; k < 8; k++) {
                w[k] = _mm256_loadu_si256((const __m256i *)(q + (g * 8 + k) * 64 + h * 32));
                size[k] = _mm256_abs_epi8(w[k]);
            }
            const __m256 dv = _mm256_loadu_ps(d + g * TILE + h * 8);
            for (int r = 0; r < n; r++) {
                const int8_t *xg = xq + r * in + g * GROUP;
                /* |q| times x8 with q's sign, pairs summed in int16 (at most 2 * 127 * 127 a lane) */
                __m256i s = _mm256_setzero_si256();
                for (int k = 0; k < 8; k++) {
                    const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(chunk(xg + 4 * k)), w[k]);
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(size[k], signed_x), ones));
                }
                const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(xd[r * groups + g]));
                a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, a[r]);
            }
        }
        for (int r = 0; r < n; r++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, a[r]);
            for (int o = 0; o < 8 && first + h * 8 + o < out; o++) y[r * out + first + h * 8 + o] = lanes[o];
        }
    }
#else
    (void)c;
    for (int r = 0; r < n; r++)
        for (int o = 0; o < TILE && first + o < out; o++) {
            float a = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const int8_t *xg = xq + r * in + g * GROUP;
                int32_t s = 0;
                for (int k = 0; k < 8; k++)
                    for (int i = 0; i < 4; i++) s += q[((g * 8 + k) * TILE + o) * 4 + i] * xg[4 * k + i];
                a = fmaf((float)s, d[g * TILE + o] * xd[r * groups + g], a);
            }
            y[r * out + first + o] = a;
        }
#endif
}

static inline __attribute__((always_inline)) void tile_block(const Inputs *xs, const int64_t r, const void *q,
                                                            const float *d, const void *extra, float *y, const int n,
                                                            const int64_t groups, const int64_t out, const int64_t t,
                                                            const int four) {
    /* rows r .. r + n - 1 of tile t: tile_rows (4-bit, extra the minimums) or tile_rows8 (8-bit, extra c) */
    const int64_t in = groups * GROUP, at = t * groups * TILE;
    if (four)
        tile_rows(xs->q + r * in, xs->d + r * groups, xs->s + r * groups, (const uint8_t *)q + at * GROUP / 2, d + at,
                  (const float *)extra + at, y + r * out, n, groups, out, t * TILE);
    else
        tile_rows8(xs->q + r * in, xs->d + r * groups, (const int8_t *)q + at * GROUP, d + at,
                   (const int32_t *)extra + at, y + r * out, n, groups, out, t * TILE);
}

static int product(const float *x, const void *q, const float *d, const void *extra, float *y, const int64_t rows,
                   const int64_t in, const int64_t out, const int threads, const int four) {
    /* 0 on success; 1 when scratch memory could not be had; 2 when in is not a multiple of GROUP (y untouched) */
    if (in % GROUP) return 2;
    const int64_t groups = in / GROUP, tiles = (out + TILE - 1) / TILE;
    Inputs xs;
    if (inputs(x, rows, in, threads, &xs)) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t r = 0;
        for (; r + ROW_BLOCK4 <= rows; r += ROW_BLOCK4)
            tile_block(&xs, r, q, d, extra, y, ROW_BLOCK4, groups, out, t, four);
        switch (rows - r) { /* the row count a constant in each call, so the accumulators stay in registers */
        case 1: tile_block(&xs, r, q, d, extra, y, 1, groups, out, t, four); break;
        case 2: tile_block(&xs, r, q, d, extra, y, 2, groups, out, t, four); break;
        case 3: tile_block(&xs, r, q, d, extra, y, 3, groups, out, t, four); break;
        default: break;
        }
    }
    release(&xs);
    return 0;
}

int miserver_int4_product(const float *x, const uint8_t *q, const float *d, const float *m, float *y, int64_t rows,
                          int64_t in, int64_t out, int threads) {
    /* the 4-bit product (see the top): 0 on success; 1 when scratch memory could not be had; 2 when in is not a
       multiple of GROUP (y untouched) */
    return product(x, q, d, m, y, rows, in, out, threads, 1);
}

int miserver_int8_product(const float *x, const int8_t *q, const float *d, const int32_t *c, float *y, int64_t rows,
                          int64_t in, int64_t out, int threads) {
    /* the 8-bit product, as miserver_int4_product */
    return product(x, q, d, c, y, rows, in, out, threads, 0);
}
