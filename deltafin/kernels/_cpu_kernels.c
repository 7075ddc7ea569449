/* Stored weights on the CPU: x @ W^T straight from the stored bytes (MXFP4, int8, int4, int6,
   bf16), and whole-row MXFP4 decoding.

   MXFP4 layout (see mxfp4.py): packed uint8 [out, in/2], byte j of a row holds element 2j in its
   low nibble and 2j+1 in its high nibble, each an E2M1 code; scale uint8 [out, in/32] holds one
   E8M0 byte per group of 32 inputs, factor 2^(s-127) (s = 0: 2^-127, a float32 subnormal;
   s = 255: NaN). Every weight is decoded as the float32 product E2M1(code) * factor, exactly as
   the torch reference does, so decoding is bit-exact and the matmul differs from the reference
   only in summation order.

   int8 layout (see int8.py): codes int8 [out, in], scale float32 [out, 1], W = codes * scale;
   grouped int8: the same codes with one float16 scale per group of `group` inputs (a multiple of
   32), [out, in/group]. The int8 gemvs take x rounded to int16, each row on its own to steps of
   max |x| / 32767 (half a step, 2^-16 of the row's largest input, is the most any input moves), and
   sum codes times those integers exactly in int32 per group, then apply the scales in float32
   (section "int8 on the integer units"): against dequantize-then-matmul the result differs by that
   rounding of x and by summation order.

   int4 / int6 layout (see intq.py): packed uint8, scale float16 [out, in/group]. int4 holds
   element 2j of a row in the low nibble of byte j and 2j+1 in its high nibble; int6 holds every
   4 elements as a 24-bit little-endian word of 6-bit fields in 3 bytes. Codes are stored plus an
   offset (8 or 32). Each weight is decoded as the float32 product (u - offset) * scale, exactly
   as the torch reference does (the AVX-512 code computes it as one FMA, u * s - offset * s,
   whose single rounding gives the same value because offset * s is exact), so the gemv differs
   from dequantize-then-matmul only by summation order. The group size must be a multiple of 8.

   bf16 layout: uint16 [out, in], each the top half of a float32's bits. Widening is exact (shift
   left 16), so the gemv differs from convert-to-float32-then-matmul only by summation order.

   Two implementations of each kernel: AVX-512 (compiled through target attributes, so the
   library itself needs no -march flag; int8: AVX-512 VNNI) and portable C; the MXFP4, int8 and bf16
   gemvs have a third, AVX2+FMA (differing from the portable code only in rounding order, like their
   AVX-512 code; for bf16 a plain AVX2 one, bit-identical, remains for CPUs without FMA). The fastest
   one the CPU has is chosen at run time (cpu_kernels_limit_simd narrows the choice). Work is split
   over output rows between `threads` pthreads (the caller's thread is one of them); a row's result
   never depends on the split.

   The functions are called through ctypes (cpu_native.py); PyInit exists only so that the file
   is also a valid (empty) extension module, which is how setuptools builds and places it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KERNELS_X86 1
#endif

/* Bumped whenever a signature below changes, or what Python assumes of a kernel (23: the MLA decode
   attention takes any cache length on AVX-512; 24: mla_attend_blocked), so Python never calls a stale
   library. */
#define KERNELS_ABI 24

#define GROUP 32
/* Rows of x and output rows handled together by the AVX-512 gemvs (16 accumulators). */
#define X_BLOCK 4
#define ROW_BLOCK 4
/* int8 elements per AVX-512 step: one 16-byte load widened to 16 floats. */
#define INT8_STEP 16
/* bf16 elements per AVX-512 step: one 32-byte load widened to 16 floats. */
#define BF16_STEP 16
/* Lanes the portable int8/bf16 code sums in, the same as both AVX-512 steps. */
#define DENSE_STEP 16
/* Elements of an int4 (16 bytes) and an int6 (12 bytes) AVX-512 step, and the packed bytes. */
#define INT4_STEP 32
#define INT6_STEP 16
#define INT6_STEP_BYTES 12
/* Elements the portable int4/int6 code decodes at once (the group size is a multiple of it). */
#define INTQ_UNIT 8
/* Below this many weights per thread, extra threads cost more than they save. */
#define MIN_WEIGHTS_PER_THREAD (1 << 18)
/* The fewest weights a thread's chunk of a job holds (run_chunked; docs/benchmarks.md, "Native CPU
   products": the value side of MLA's heads over DRAM 227 us a layer with no floor, 149 with this one). */
#define MIN_CHUNK_WEIGHTS (1 << 16)

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static float e8m0_factor(unsigned s) {
    uint32_t bits = s == 0 ? (1u << 22) : s == 255 ? 0x7FC00000u : (uint32_t)s << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

enum out_kind { OUT_F32 = 0, OUT_BF16 = 1 };

/* One call's arguments, shared read-only by its threads. */
struct job {
    const float *x;          /* [m, n] as given (portable MXFP4 path, bf16 paths; int8: rounded in xq) */
    const float *x_even;     /* [m, n/2]: x[:, 0::2] (AVX-512 MXFP4 gemv) */
    const float *x_odd;      /* [m, n/2]: x[:, 1::2] */
    const uint8_t *packed;   /* MXFP4 [out, n/2] */
    const uint8_t *scale;    /* MXFP4 [out, n/32] */
    const int8_t *codes;     /* int8 [out, n] */
    const float *row_scale;  /* int8 [out]; NULL for grouped int8 (half_scale, group) and bf16 */
    const int16_t *xq;       /* int8 gemvs: x [m, n] rounded to int16, one scale per row (x_scale [m]) */
    const float *x_scale;
    const uint16_t *bf16;    /* bf16 bits [out, n] */
    const uint16_t *half_scale;  /* int4/int6 and grouped int8: float16 bits [out, n/group] */
    const int32_t *lane_group;   /* int4/int6 AVX-512, groups not aligned to steps: [steps, 16] */
    int64_t group, steps, x_stride;  /* int4/int6, grouped int8: group size; AVX-512 steps per row; x row stride */
    int bits;                    /* int4/int6: 4 or 6 */
    int il16;                    /* grouped int8 (group of 32, 64 or 128) interleaved by blocks of IL_BLOCK inputs
                                    (int8.py int8_interleave) */
    void *y;                 /* gemv: float [m, out]; dequant: [out, n] float or bf16 bits */
    int64_t m, out, n;
    int64_t depth;           /* transposed dense products: the rows of W summed over (W is [depth, n]) */
    int kind;                /* enum out_kind, dequant only */
    const float *factor;     /* E8M0 byte -> factor (MXFP4 only): e8m0_factors() */
};

typedef void (*rows_fn)(const struct job *, int64_t r0, int64_t r1);

/* ------------------------------------------------------------------ portable code */

static void decode_group(const uint8_t *p, float f, float *w) {
    for (int j = 0; j < GROUP / 2; j++) {
        w[2 * j] = E2M1[p[j] & 15] * f;
        w[2 * j + 1] = E2M1[p[j] >> 4] * f;
    }
}

static void mxfp4_gemv_rows_portable(const struct job *jb, int64_t r0, int64_t r1) {
    const int64_t n = jb->n, groups = n / GROUP;
    float *y = (float *)jb->y;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *p = jb->packed + r * (n / 2);
        const uint8_t *s = jb->scale + r * groups;
        for (int64_t m0 = 0; m0 < jb->m; m0 += X_BLOCK) {
            const int64_t mb = jb->m - m0 < X_BLOCK ? jb->m - m0 : X_BLOCK;
            /* One partial sum per lane of a group: loops the compiler can vectorize. */
            float acc[X_BLOCK][GROUP] = {{0}};
            float w[GROUP];
            for (int64_t g = 0; g < groups; g++) {
                decode_group(p + g * (GROUP / 2), jb->factor[s[g]], w);
                for (int64_t i = 0; i < mb; i++) {
                    const float *xg = jb->x + (m0 + i) * n + g * GROUP;
                    for (int k = 0; k < GROUP; k++) acc[i][k] += w[k] * xg[k];
                }
            }
            for (int64_t i = 0; i < mb; i++) {
                float sum = 0.0f;
                for (int k = 0; k < GROUP; k++) sum += acc[i][k];
                y[(m0 + i) * jb->out + r] = sum;
            }
        }
    }
}

static void mxfp4_dequant_rows_portable(const struct job *jb, int64_t r0, int64_t r1) {
    const int64_t n = jb->n, groups = n / GROUP;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *p = jb->packed + r * (n / 2);
        const uint8_t *s = jb->scale + r * groups;
        for (int64_t g = 0; g < groups; g++) {
            float w[GROUP];
            decode_group(p + g * (GROUP / 2), jb->factor[s[g]], w);
            if (jb->kind == OUT_F32) {
                memcpy((float *)jb->y + r * n + g * GROUP, w, sizeof w);
            } else {
                /* Decoded values have at most 2 significant bits, so bf16 holds them exactly:
                   the top half of the float32 bits is the correctly rounded bf16. */
                uint16_t *o = (uint16_t *)jb->y + r * n + g * GROUP;
                for (int k = 0; k < GROUP; k++) {
                    uint32_t bits;
                    memcpy(&bits, &w[k], sizeof bits);
                    o[k] = (uint16_t)(bits >> 16);
                }
            }
        }
    }
}

static float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float half_to_float(uint16_t h);

/* The float16 scale of the group holding element k of row r of a grouped int8 weight. */
static inline uint16_t int8_group_scale(const struct job *jb, int64_t r, int64_t k) {
    return jb->half_scale[r * (jb->n / jb->group) + k / jb->group];
}

/* Element k of row r of a dense weight (int8 codes, times the group's scale for grouped int8, or
   bf16 bits), as float. */
static inline float dense_weight(const struct job *jb, int64_t r, int64_t k) {
    const int64_t at = r * jb->n + k;
    if (!jb->codes) return bf16_to_float(jb->bf16[at]);
    return jb->half_scale ? (float)jb->codes[at] * half_to_float(int8_group_scale(jb, r, k)) : (float)jb->codes[at];
}

/* bf16 (one element per weight; int8 has its own products, int8q_rows_portable). */
static void dense_gemv_rows_portable(const struct job *jb, int64_t r0, int64_t r1) {
    const int64_t n = jb->n, body = n - n % DENSE_STEP;
    float *y = (float *)jb->y;
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t m0 = 0; m0 < jb->m; m0 += X_BLOCK) {
            const int64_t mb = jb->m - m0 < X_BLOCK ? jb->m - m0 : X_BLOCK;
            /* One partial sum per lane of a step, as the AVX-512 code sums. */
            float acc[X_BLOCK][DENSE_STEP] = {{0}};
            for (int64_t k0 = 0; k0 < body; k0 += DENSE_STEP) {
                float w[DENSE_STEP];
                for (int k = 0; k < DENSE_STEP; k++) w[k] = dense_weight(jb, r, k0 + k);
                for (int64_t i = 0; i < mb; i++) {
                    const float *xk = jb->x + (m0 + i) * n + k0;
                    for (int k = 0; k < DENSE_STEP; k++) acc[i][k] += w[k] * xk[k];
                }
            }
            for (int64_t i = 0; i < mb; i++) {
                const float *xi = jb->x + (m0 + i) * n;
                float sum = 0.0f;
                for (int k = 0; k < DENSE_STEP; k++) sum += acc[i][k];
                for (int64_t k = body; k < n; k++) sum += dense_weight(jb, r, k) * xi[k];
                y[(m0 + i) * jb->out + r] = sum;
            }
        }
    }
}

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 31u, man = h & 1023u, bits;
    if (exp == 31) {
        bits = sign | 0x7F800000u | man << 13;          /* inf, NaN */
    } else if (exp != 0) {
        bits = sign | (exp + 112) << 23 | man << 13;    /* rebias 15 -> 127 */
    } else if (man == 0) {
        bits = sign;
    } else {
        /* Subnormal man * 2^-24: normalize into a float32 normal. */
        exp = 113;
        while (!(man & 1024u)) man <<= 1, exp--;
        bits = sign | exp << 23 | (man & 1023u) << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static int64_t intq_row_bytes(int bits, int64_t n) { return bits == 4 ? n / 2 : n / 4 * 3; }

/* Elements k0..k0+7 of a packed int4/int6 row, times the group's scale s. */
static void intq_decode_unit(const uint8_t *p, int bits, int64_t k0, float s, float *w) {
    if (bits == 4) {
        for (int j = 0; j < INTQ_UNIT / 2; j++) {
            const uint8_t b = p[k0 / 2 + j];
            w[2 * j] = (float)((int)(b & 15) - 8) * s;
            w[2 * j + 1] = (float)((int)(b >> 4) - 8) * s;
        }
        return;
    }
    for (int t = 0; t < INTQ_UNIT / 4; t++) {
        const uint8_t *q = p + (k0 / 4 + t) * 3;
        const uint32_t word = q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16;
        for (int j = 0; j < 4; j++) w[4 * t + j] = (float)((int)((word >> (6 * j)) & 63) - 32) * s;
    }
}

static void intq_gemv_rows_portable(const struct job *jb, int64_t r0, int64_t r1) {
    const int64_t n = jb->n, groups = n / jb->group, row_bytes = intq_row_bytes(jb->bits, n);
    float *y = (float *)jb->y;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *p = jb->packed + r * row_bytes;
        const uint16_t *hs = jb->half_scale + r * groups;
        for (int64_t m0 = 0; m0 < jb->m; m0 += X_BLOCK) {
            const int64_t mb = jb->m - m0 < X_BLOCK ? jb->m - m0 : X_BLOCK;
            /* One partial sum per lane of a unit: loops the compiler can vectorize. */
            float acc[X_BLOCK][INTQ_UNIT] = {{0}};
            float w[INTQ_UNIT];
            for (int64_t k0 = 0; k0 < n; k0 += INTQ_UNIT) {
                intq_decode_unit(p, jb->bits, k0, half_to_float(hs[k0 / jb->group]), w);
                for (int64_t i = 0; i < mb; i++) {
                    const float *xk = jb->x + (m0 + i) * n + k0;
                    for (int k = 0; k < INTQ_UNIT; k++) acc[i][k] += w[k] * xk[k];
                }
            }
            for (int64_t i = 0; i < mb; i++) {
                float sum = 0.0f;
                for (int k = 0; k < INTQ_UNIT; k++) sum += acc[i][k];
                y[(m0 + i) * jb->out + r] = sum;
            }
        }
    }
}

/* ------------------------------------------------------------------ AVX-512 */

#ifdef KERNELS_X86
#define AVX512 __attribute__((target("avx512f,f16c")))

/* 16 bf16 values from p as floats (exact: the bits shifted into place). */
static inline __attribute__((always_inline)) AVX512 __m512 bf16x16_avx512(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 values from element j of p, float32 or (bf16) bf16 bits, as floats. */
static inline __attribute__((always_inline)) AVX512 __m512 load16_avx512(const void *p, int bf16, int64_t j) {
    return bf16 ? bf16x16_avx512((const uint16_t *)p + j) : _mm512_loadu_ps((const float *)p + j);
}

/* The 16 E2M1 values times the group's factor: vpermps then decodes 16 codes in one step. */
#define E2M1_VECTOR() \
    _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, \
                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f)

/* Output rows r..r+R-1 for rows m0..m0+MB-1 of x. R and MB are constants at every call site, so
   the R*MB accumulators stay in registers. Several output rows share each load of x, which
   matters once x (MB rows) no longer fits in L1.
   `next`, when >= 0, is the first of the R rows the caller handles next: their packed bytes
   (one cache line per group when R = 4) and scales are prefetched while this block computes, so
   that memory latency overlaps the work (hardware prefetching alone reached ~3 GB/s of packed
   weights on one core of a Xeon, this ~5 GB/s). */
static inline __attribute__((always_inline)) AVX512 void
mxfp4_gemv_block_avx512(const struct job *jb, int64_t r, int64_t m0, const int R, const int MB,
                        const int64_t next) {
    const int64_t half = jb->n / 2, groups = jb->n / GROUP;
    /* The R rows' packed bytes and scales: R*16 and R bytes per group. */
    const char *next_packed = next >= 0 ? (const char *)(jb->packed + next * half) : NULL;
    const char *next_scale = next >= 0 ? (const char *)(jb->scale + next * groups) : NULL;
    const __m512 values = E2M1_VECTOR();
    __m512 acc[ROW_BLOCK][X_BLOCK];
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) acc[k][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (next_packed) {
            _mm_prefetch(next_packed + g * R * 16, _MM_HINT_T0);
            if (((g * R) & 63) == 0) _mm_prefetch(next_scale + g * R, _MM_HINT_T0);
        }
        __m512 w_even[ROW_BLOCK], w_odd[ROW_BLOCK];
        for (int k = 0; k < R; k++) {
            const uint8_t *p = jb->packed + (r + k) * half + g * 16;
            const float f = jb->factor[jb->scale[(r + k) * groups + g]];
            const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(f));
            const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
            /* vpermps reads only the low 4 bits of each index: no mask needed for the low nibble. */
            w_even[k] = _mm512_permutexvar_ps(bytes, table);
            w_odd[k] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
        }
        for (int i = 0; i < MB; i++) {
            const int64_t off = (m0 + i) * half + g * 16;
            const __m512 xe = _mm512_loadu_ps(jb->x_even + off);
            const __m512 xo = _mm512_loadu_ps(jb->x_odd + off);
            for (int k = 0; k < R; k++)
                acc[k][i] = _mm512_fmadd_ps(w_odd[k], xo, _mm512_fmadd_ps(w_even[k], xe, acc[k][i]));
        }
    }
    float *y = (float *)jb->y;
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) y[(m0 + i) * jb->out + r + k] = _mm512_reduce_add_ps(acc[k][i]);
}

/* bf16 counterpart of the int8 block: 16 weights (32 bytes) widen exactly to 16 floats per step
   and row (zero-extend to 32 bits, shift into the high half). The R rows of `next` are
   contiguous, R*32 bytes per step: two cache lines when R = 4, prefetched into L2 as for int8.
   The last n % 16 elements are summed in scalar code. */
static inline __attribute__((always_inline)) AVX512 void
bf16_gemv_block_avx512(const struct job *jb, int64_t r, int64_t m0, const int R, const int MB,
                       const int64_t next) {
    const int64_t n = jb->n, body = n - n % BF16_STEP;
    const uint16_t *w = jb->bf16 + r * n;
    const float *x = jb->x + m0 * n;
    const char *next_w = next >= 0 ? (const char *)(jb->bf16 + next * n) : NULL;
    __m512 acc[ROW_BLOCK][X_BLOCK];
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) acc[k][i] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < body; k0 += BF16_STEP) {
        if (next_w) {
            _mm_prefetch(next_w + k0 * R * 2, _MM_HINT_T1);
            if (R * BF16_STEP * 2 > 64) _mm_prefetch(next_w + k0 * R * 2 + 64, _MM_HINT_T1);
        }
        __m512 wv[ROW_BLOCK];
        for (int k = 0; k < R; k++) wv[k] = bf16x16_avx512(w + k * n + k0);
        for (int i = 0; i < MB; i++) {
            const __m512 xv = _mm512_loadu_ps(x + i * n + k0);
            for (int k = 0; k < R; k++) acc[k][i] = _mm512_fmadd_ps(wv[k], xv, acc[k][i]);
        }
    }
    float *y = (float *)jb->y;
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) {
            float sum = _mm512_reduce_add_ps(acc[k][i]);
            for (int64_t j = body; j < n; j++) sum += bf16_to_float(w[k * n + j]) * x[i * n + j];
            y[(m0 + i) * jb->out + r + k] = sum;
        }
}

/* Output rows r..r+R-1 for every row of x, X_BLOCK rows of x at a time, by `block` (one of the
   three above); the first pass over the weight rows prefetches rows `next` onward (-1: none). */
#define GEMV_ROWS_BLOCK(block, jb, r, R, next)                                 \
    do {                                                                       \
        int64_t m0_ = 0, next_ = (next);                                       \
        for (; m0_ + X_BLOCK <= (jb)->m; m0_ += X_BLOCK, next_ = -1)           \
            block(jb, r, m0_, R, X_BLOCK, next_);                              \
        switch ((jb)->m - m0_) {                                               \
        case 3: block(jb, r, m0_, R, 3, next_); break;                         \
        case 2: block(jb, r, m0_, R, 2, next_); break;                         \
        case 1: block(jb, r, m0_, R, 1, next_); break;                         \
        default: break;                                                        \
        }                                                                      \
    } while (0)

/* Rows r0..r1-1, ROW_BLOCK at a time, each block prefetching the next; leftover rows one by one. */
#define GEMV_ROWS(block, jb, r0, r1)                                           \
    do {                                                                       \
        int64_t r_ = (r0);                                                     \
        for (; r_ + ROW_BLOCK <= (r1); r_ += ROW_BLOCK)                        \
            GEMV_ROWS_BLOCK(block, jb, r_, ROW_BLOCK,                          \
                            r_ + 2 * ROW_BLOCK <= (r1) ? r_ + ROW_BLOCK : -1); \
        for (; r_ < (r1); r_++) GEMV_ROWS_BLOCK(block, jb, r_, 1, -1);         \
    } while (0)

static AVX512 void mxfp4_gemv_rows_avx512(const struct job *jb, int64_t r0, int64_t r1) {
    GEMV_ROWS(mxfp4_gemv_block_avx512, jb, r0, r1);
}

static AVX512 void bf16_gemv_rows_avx512(const struct job *jb, int64_t r0, int64_t r1) {
    GEMV_ROWS(bf16_gemv_block_avx512, jb, r0, r1);
}

/* The scale of each of the 16 lanes of step c (E elements per step) of one row, from the row's
   scales widened to float32 in `s` (followed by 16 zeros). When steps never straddle a group
   boundary, one broadcast; otherwise lane_group maps each lane to its group, counted from the
   step's first group, and lanes past the row's end to a zero. */
static inline __attribute__((always_inline)) AVX512 __m512
intq_lane_scales(const struct job *jb, const float *s, int64_t c, int64_t E) {
    const int64_t g0 = c * E / jb->group;
    if (!jb->lane_group) return _mm512_set1_ps(s[g0]);
    return _mm512_permutexvar_ps(_mm512_loadu_si512(jb->lane_group + c * 16), _mm512_loadu_ps(s + g0));
}

/* 16 packed bytes of step c at byte offset `at` of a row of `row_bytes`; near the row's end the
   bytes left are copied into zeros, so that nothing past the weight is read. */
static inline __attribute__((always_inline)) AVX512 __m128i
intq_load_step(const uint8_t *row, int64_t at, int64_t step_bytes, int64_t row_bytes) {
    if (at + 16 <= row_bytes) return _mm_loadu_si128((const __m128i *)(row + at));
    uint8_t tail[16] = {0};
    const int64_t left = row_bytes - at;
    memcpy(tail, row + at, (size_t)(left < step_bytes ? left : step_bytes));
    return _mm_loadu_si128((const __m128i *)tail);
}

/* int4 counterpart of the MXFP4 block: 16 bytes decode to the even and odd elements of a step
   of 32, which meet the de-interleaved x. `s` holds the R rows' float32 scales, `stride` apart.
   The R rows of `next` are contiguous, R*16 bytes per step: one cache line when R = 4,
   prefetched into L2 as for int8. */
static inline __attribute__((always_inline)) AVX512 void
int4_gemv_block_avx512(const struct job *jb, int64_t r, int64_t m0, const int R, const int MB,
                       const int64_t next, const float *s, const int64_t stride) {
    const int64_t row_bytes = jb->n / 2;
    const char *next_packed = next >= 0 ? (const char *)(jb->packed + next * row_bytes) : NULL;
    const __m512i nibble = _mm512_set1_epi32(15);
    const __m512 minus_offset = _mm512_set1_ps(-8.0f);
    __m512 acc[ROW_BLOCK][X_BLOCK];
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) acc[k][i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < jb->steps; c++) {
        if (next_packed) _mm_prefetch(next_packed + c * R * 16, _MM_HINT_T1);
        __m512 w_even[ROW_BLOCK], w_odd[ROW_BLOCK];
        for (int k = 0; k < R; k++) {
            const __m512i bytes = _mm512_cvtepu8_epi32(
                intq_load_step(jb->packed + (r + k) * row_bytes, c * 16, 16, row_bytes));
            const __m512 sv = intq_lane_scales(jb, s + k * stride, c, INT4_STEP);
            const __m512 bias = _mm512_mul_ps(sv, minus_offset);
            w_even[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, nibble)), sv, bias);
            w_odd[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), sv, bias);
        }
        for (int i = 0; i < MB; i++) {
            const int64_t off = (m0 + i) * jb->x_stride + c * 16;
            const __m512 xe = _mm512_loadu_ps(jb->x_even + off);
            const __m512 xo = _mm512_loadu_ps(jb->x_odd + off);
            for (int k = 0; k < R; k++)
                acc[k][i] = _mm512_fmadd_ps(w_odd[k], xo, _mm512_fmadd_ps(w_even[k], xe, acc[k][i]));
        }
    }
    float *y = (float *)jb->y;
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) y[(m0 + i) * jb->out + r + k] = _mm512_reduce_add_ps(acc[k][i]);
}

/* int6: 12 bytes decode to 16 consecutive elements. A byte shuffle zero-extends each 3-byte word
   to 32 bits, a permute gives each lane its word, a per-lane shift and mask its 6-bit field.
   x is read in place (padded with zeros to whole steps). The R rows of `next` are R*12 bytes per
   step, so one prefetch per step still touches every cache line. */
static inline __attribute__((always_inline)) AVX512 void
int6_gemv_block_avx512(const struct job *jb, int64_t r, int64_t m0, const int R, const int MB,
                       const int64_t next, const float *s, const int64_t stride) {
    const int64_t row_bytes = jb->n / 4 * 3;
    const char *next_packed = next >= 0 ? (const char *)(jb->packed + next * row_bytes) : NULL;
    const __m128i words = _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i shifts = _mm512_setr_epi32(0, 6, 12, 18, 0, 6, 12, 18, 0, 6, 12, 18, 0, 6, 12, 18);
    const __m512i field = _mm512_set1_epi32(63);
    const __m512 minus_offset = _mm512_set1_ps(-32.0f);
    __m512 acc[ROW_BLOCK][X_BLOCK];
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) acc[k][i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < jb->steps; c++) {
        if (next_packed) _mm_prefetch(next_packed + c * R * INT6_STEP_BYTES, _MM_HINT_T1);
        __m512 w[ROW_BLOCK];
        for (int k = 0; k < R; k++) {
            const __m128i raw = intq_load_step(jb->packed + (r + k) * row_bytes, c * INT6_STEP_BYTES,
                                               INT6_STEP_BYTES, row_bytes);
            const __m512i lanes = _mm512_permutexvar_epi32(
                spread, _mm512_castsi128_si512(_mm_shuffle_epi8(raw, words)));
            const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(lanes, shifts), field);
            const __m512 sv = intq_lane_scales(jb, s + k * stride, c, INT6_STEP);
            w[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes), sv, _mm512_mul_ps(sv, minus_offset));
        }
        for (int i = 0; i < MB; i++) {
            const __m512 xv = _mm512_loadu_ps(jb->x_even + (m0 + i) * jb->x_stride + c * INT6_STEP);
            for (int k = 0; k < R; k++) acc[k][i] = _mm512_fmadd_ps(w[k], xv, acc[k][i]);
        }
    }
    float *y = (float *)jb->y;
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) y[(m0 + i) * jb->out + r + k] = _mm512_reduce_add_ps(acc[k][i]);
}

/* The scales of rows r..r+R-1 widened to float32 into s (row k at s + k * stride). */
static AVX512 void intq_widen_scales(const struct job *jb, int64_t r, int R, float *s, int64_t stride) {
    const int64_t groups = jb->n / jb->group;
    for (int k = 0; k < R; k++) {
        const uint16_t *h = jb->half_scale + (r + k) * groups;
        float *o = s + k * stride;
        int64_t g = 0;
        for (; g + 16 <= groups; g += 16)
            _mm512_storeu_ps(o + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + g))));
        for (; g < groups; g++) o[g] = half_to_float(h[g]);
    }
}

/* As GEMV_ROWS_BLOCK, for the int4/int6 blocks, which also take the rows' float32 scales. */
#define INTQ_ROWS_BLOCK(block, jb, r, R, next, s, stride)                      \
    do {                                                                       \
        int64_t m0_ = 0, next_ = (next);                                       \
        for (; m0_ + X_BLOCK <= (jb)->m; m0_ += X_BLOCK, next_ = -1)           \
            block(jb, r, m0_, R, X_BLOCK, next_, s, stride);                   \
        switch ((jb)->m - m0_) {                                               \
        case 3: block(jb, r, m0_, R, 3, next_, s, stride); break;              \
        case 2: block(jb, r, m0_, R, 2, next_, s, stride); break;              \
        case 1: block(jb, r, m0_, R, 1, next_, s, stride); break;              \
        default: break;                                                        \
        }                                                                      \
    } while (0)

/* As GEMV_ROWS, widening each block's scales first into per-thread scratch (a row's scales and
   16 zeros for the lanes past its end); without scratch, the portable code runs instead. */
#define INTQ_ROWS(block, jb, r0, r1)                                                      \
    do {                                                                                  \
        const int64_t stride_ = (jb)->n / (jb)->group + 16;                               \
        float *s_ = calloc((size_t)(ROW_BLOCK * stride_), sizeof *s_);                    \
        if (!s_) {                                                                        \
            intq_gemv_rows_portable(jb, r0, r1);                                          \
            break;                                                                        \
        }                                                                                 \
        int64_t r_ = (r0);                                                                \
        for (; r_ + ROW_BLOCK <= (r1); r_ += ROW_BLOCK) {                                 \
            intq_widen_scales(jb, r_, ROW_BLOCK, s_, stride_);                            \
            INTQ_ROWS_BLOCK(block, jb, r_, ROW_BLOCK,                                     \
                            r_ + 2 * ROW_BLOCK <= (r1) ? r_ + ROW_BLOCK : -1, s_, stride_); \
        }                                                                                 \
        for (; r_ < (r1); r_++) {                                                         \
            intq_widen_scales(jb, r_, 1, s_, stride_);                                    \
            INTQ_ROWS_BLOCK(block, jb, r_, 1, -1, s_, stride_);                           \
        }                                                                                 \
        free(s_);                                                                         \
    } while (0)

static AVX512 void int4_gemv_rows_avx512(const struct job *jb, int64_t r0, int64_t r1) {
    INTQ_ROWS(int4_gemv_block_avx512, jb, r0, r1);
}

static AVX512 void int6_gemv_rows_avx512(const struct job *jb, int64_t r0, int64_t r1) {
    INTQ_ROWS(int6_gemv_block_avx512, jb, r0, r1);
}

static AVX512 void mxfp4_dequant_rows_avx512(const struct job *jb, int64_t r0, int64_t r1) {
    const int64_t n = jb->n, groups = n / GROUP;
    const __m512 values = E2M1_VECTOR();
    /* Re-interleave even and odd elements: lanes 0..15 of the output are e0 o0 e1 o1 ... e7 o7. */
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *p = jb->packed + r * (n / 2);
        const uint8_t *s = jb->scale + r * groups;
        for (int64_t g = 0; g < groups; g++) {
            const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(jb->factor[s[g]]));
            const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + g * 16)));
            const __m512 w_even = _mm512_permutexvar_ps(bytes, table);
            const __m512 w_odd = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
            const __m512 lo = _mm512_permutex2var_ps(w_even, first, w_odd);
            const __m512 hi = _mm512_permutex2var_ps(w_even, second, w_odd);
            const int64_t at = r * n + g * GROUP;
            if (jb->kind == OUT_F32) {
                _mm512_storeu_ps((float *)jb->y + at, lo);
                _mm512_storeu_ps((float *)jb->y + at + 16, hi);
            } else {
                uint16_t *o = (uint16_t *)jb->y + at;
                _mm256_storeu_si256((__m256i *)o,
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(lo), 16)));
                _mm256_storeu_si256((__m256i *)(o + 16),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(hi), 16)));
            }
        }
    }
}
#endif

#ifdef KERNELS_X86
#define AVX2 __attribute__((target("avx2")))

/* 16 bf16 weights of a row from element `at`, as floats (exactly): lanes 0-7 in *lo, 8-15 in *hi. */
static AVX2 inline void dense_load16_avx2(const struct job *jb, int64_t at, __m256 *lo, __m256 *hi) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)(jb->bf16 + at));
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(b)), 16));
    *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(b, 1)), 16));
}

/* The portable bf16 gemv with its DENSE_STEP lanes held in two AVX2 registers: the same
   products and sums in the same order (multiply then add, no FMA), hence the same bits, for
   processors with AVX2 but not FMA (measured ~2.5x the portable code's speed on one). */
static AVX2 void dense_gemv_rows_avx2(const struct job *jb, int64_t r0, int64_t r1) {
    const int64_t n = jb->n, body = n - n % DENSE_STEP;
    float *y = (float *)jb->y;
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t m0 = 0; m0 < jb->m; m0 += X_BLOCK) {
            const int64_t mb = jb->m - m0 < X_BLOCK ? jb->m - m0 : X_BLOCK;
            __m256 lo[X_BLOCK], hi[X_BLOCK];
            for (int i = 0; i < X_BLOCK; i++) lo[i] = hi[i] = _mm256_setzero_ps();
            for (int64_t k0 = 0; k0 < body; k0 += DENSE_STEP) {
                __m256 wl, wh;
                dense_load16_avx2(jb, r * n + k0, &wl, &wh);
                for (int64_t i = 0; i < mb; i++) {
                    const float *xk = jb->x + (m0 + i) * n + k0;
                    lo[i] = _mm256_add_ps(lo[i], _mm256_mul_ps(wl, _mm256_loadu_ps(xk)));
                    hi[i] = _mm256_add_ps(hi[i], _mm256_mul_ps(wh, _mm256_loadu_ps(xk + 8)));
                }
            }
            for (int64_t i = 0; i < mb; i++) {
                float acc[DENSE_STEP];
                _mm256_storeu_ps(acc, lo[i]);
                _mm256_storeu_ps(acc + 8, hi[i]);
                const float *xi = jb->x + (m0 + i) * n;
                float sum = 0.0f;
                for (int k = 0; k < DENSE_STEP; k++) sum += acc[k];
                for (int64_t k = body; k < n; k++) sum += dense_weight(jb, r, k) * xi[k];
                y[(m0 + i) * jb->out + r] = sum;
            }
        }
    }
}

#endif

#ifdef KERNELS_X86
#define AVX2_FMA __attribute__((target("avx2,fma,f16c")))
/* Blocks of the AVX2+FMA dense gemvs, each within the 16 vector registers: every (output row, row of x)
   pair takes 2 accumulators (the 16 lanes of a step, summed apart as the portable code sums them).
   One row of x: 4 output rows (8 accumulators) share each load of x. Several rows of x: 2 output
   rows x 3 rows of x (12 accumulators), so each widened weight feeds 3 rows' FMAs instead of one
   (widening costs about as many instructions as the FMAs it feeds; x is read by the FMAs themselves). */
#define X_BLOCK_AVX2 3
#define ROW_BLOCK_AVX2_MULTI 2

/* bf16 weights on AVX2 with FMA: output rows r..r+R-1 for rows m0..m0+MB-1 of x. Each step widens 16
   weights of a row exactly to two float vectors (the loads folded into the widening instructions) and
   fuses them into two accumulators per (row, row of x), its 16 lanes summed apart and then in order as
   the portable code sums them (one accumulator of 8 lanes, half the partial sums, made the rounding of
   a 2304-long bf16 row visibly larger); several output rows share each load of x. Against the portable
   code's separate multiply and add (about half the products per cycle: measured on int8 weights when
   they took this path, 11.6 against 23.3 G weights/s on one core of an AVX2 EPYC with the weights in
   L2) it differs only in rounding order, like the AVX-512 code. `next`, when >= 0, is the first of the
   R rows handled next: every cache line of theirs is prefetched while this block computes (one line
   per 64 bytes of this block's rows; prefetching only every fourth line, and widening from a register,
   read weights from DRAM at 8.4 GB/s on one core, this at 15.7). */
static inline __attribute__((always_inline)) AVX2_FMA void
bf16_fma_block_avx2(const struct job *jb, int64_t r, int64_t m0, const int R, const int MB, const int64_t next) {
    const int64_t n = jb->n, body = n - n % DENSE_STEP;
    const uint16_t *w = jb->bf16 + r * n;
    const float *x = jb->x + m0 * n;
    const char *next_w = next < 0 ? NULL : (const char *)(jb->bf16 + next * n);
    __m256 acc[ROW_BLOCK][X_BLOCK_AVX2][2];  /* R x MB of them used */
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) acc[k][i][0] = acc[k][i][1] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < body; k0 += DENSE_STEP) {
        if (next_w && ((k0 * R * 2) & 63) == 0) {  /* R * 32 bytes of the next rows per step */
            _mm_prefetch(next_w + k0 * R * 2, _MM_HINT_T1);
            if (R * DENSE_STEP * 2 > 64) _mm_prefetch(next_w + k0 * R * 2 + 64, _MM_HINT_T1);
        }
        for (int k = 0; k < R; k++) {
            const uint16_t *p = w + k * n + k0;
            const __m256 lo = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
            const __m256 hi = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8))), 16));
            for (int i = 0; i < MB; i++) {
                acc[k][i][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + i * n + k0), acc[k][i][0]);
                acc[k][i][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + i * n + k0 + 8), acc[k][i][1]);
            }
        }
    }
    float *y = (float *)jb->y;
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) {
            float lanes[DENSE_STEP];
            _mm256_storeu_ps(lanes, acc[k][i][0]);
            _mm256_storeu_ps(lanes + 8, acc[k][i][1]);
            float sum = 0.0f;
            for (int j = 0; j < DENSE_STEP; j++) sum += lanes[j];
            for (int64_t j = body; j < n; j++) sum += bf16_to_float(w[k * n + j]) * x[i * n + j];
            y[(m0 + i) * jb->out + r + k] = sum;
        }
}

/* MXFP4 on AVX2 with FMA. A group's 32 codes decode straight to the float32 bits of their E2M1 values:
   those have two zero low bytes, so two byte shuffles look up the upper two bytes (sign and exponent,
   exponent and mantissa) and two interleaves with zero place them; each weight is then that value
   times the group's factor, the very product the portable decode_group computes (same bits). The
   lanes come out in the order the shuffles leave them, not in element order: register q holds
   elements 8q, 8q+2, 8q+4, 8q+6 (the low nibbles of bytes 4q..4q+3) then 8q+1, .., 8q+7 (their high
   nibbles), and x is copied once per call into that order (mxfp4_lanes_avx2). Against the decode
   through int8 -> float conversions it replaced (bit-identical to the portable code, multiply then
   add), this is about half the instructions per group; the FMAs round once per product, so a
   result differs from the portable code's by summation rounding only (like the AVX-512 code). */
#define MXFP4_KIND 2

/* Element of a group that lane l of register q holds. */
static inline int64_t mxfp4_lane_element(int64_t q, int64_t l) { return 8 * q + (l < 4 ? 2 * l : 2 * (l - 4) + 1); }

/* x [m, n] with every group's 32 inputs in the decoded lanes' order, into xs [m, n]. */
static void mxfp4_lanes_avx2(const float *x, int64_t m, int64_t n, float *xs) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < n; g += GROUP)
            for (int64_t j = 0; j < GROUP; j++) xs[i * n + g + j] = x[i * n + g + mxfp4_lane_element(j / 8, j % 8)];
}

static AVX2_FMA inline void mxfp4_decode_group_fma(const uint8_t *p, const float f, __m256 w[4]) {
    /* Byte 3 (sign, exponent) and byte 2 (exponent low bit, mantissa) of 0, .5, 1, 1.5, 2, 3, 4, 6
       and their negatives, in both 128-bit lanes (vpshufb looks up within a lane). */
    const __m256i top = _mm256_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                         (char)0x80, (char)0xBF, (char)0xBF, (char)0xBF,
                                         (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0,
                                         0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                         (char)0x80, (char)0xBF, (char)0xBF, (char)0xBF,
                                         (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0);
    const __m256i next = _mm256_setr_epi8(0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0,
                                          0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0,
                                          0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0,
                                          0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0);
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    /* Lane 0: the low nibbles (even elements), lane 1: the high nibbles (odd elements). */
    const __m256i codes = _mm256_and_si256(_mm256_blend_epi32(bytes, _mm256_srli_epi16(bytes, 4), 0xF0),
                                           _mm256_set1_epi8(15));
    const __m256i hi = _mm256_shuffle_epi8(top, codes), lo = _mm256_shuffle_epi8(next, codes);
    const __m256i h0 = _mm256_unpacklo_epi8(lo, hi), h1 = _mm256_unpackhi_epi8(lo, hi), z = _mm256_setzero_si256();
    const __m256 fv = _mm256_set1_ps(f);
    w[0] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h0)), fv);
    w[1] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h0)), fv);
    w[2] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h1)), fv);
    w[3] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h1)), fv);
}

/* The sum of the 8 lanes, in one fixed order. */
static AVX2_FMA inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* MXFP4 output rows r..r+R-1 for rows m0..m0+MB-1 of x (in the lanes' order), as the dense block: two
   accumulators per (row, row of x), registers 0 and 2 of a group into one, 1 and 3 into the other,
   the same in every block shape. `next` (>= 0): the rows handled next, whose packed bytes and scales
   are prefetched one cache line per 64 bytes. */
static inline __attribute__((always_inline)) AVX2_FMA void
mxfp4_fma_block_avx2(const struct job *jb, int64_t r, int64_t m0, const int R, const int MB, const int64_t next) {
    const int64_t n = jb->n, half = n / 2, groups = n / GROUP;
    const float *x = jb->x + m0 * n;
    const char *next_packed = next >= 0 ? (const char *)(jb->packed + next * half) : NULL;
    const char *next_scale = next >= 0 ? (const char *)(jb->scale + next * groups) : NULL;
    __m256 acc[ROW_BLOCK][X_BLOCK_AVX2][2];  /* R x MB of them used */
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) acc[k][i][0] = acc[k][i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (next_packed && ((g * R * 16) & 63) == 0) {
            _mm_prefetch(next_packed + g * R * 16, _MM_HINT_T1);
            if (((g * R) & 63) == 0) _mm_prefetch(next_scale + g * R, _MM_HINT_T1);
        }
        for (int k = 0; k < R; k++) {
            __m256 w[4];
            mxfp4_decode_group_fma(jb->packed + (r + k) * half + g * 16, jb->factor[jb->scale[(r + k) * groups + g]], w);
            for (int i = 0; i < MB; i++) {
                const float *xg = x + i * n + g * GROUP;
                acc[k][i][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg), acc[k][i][0]);
                acc[k][i][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), acc[k][i][1]);
                acc[k][i][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), acc[k][i][0]);
                acc[k][i][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), acc[k][i][1]);
            }
        }
    }
    float *y = (float *)jb->y;
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) y[(m0 + i) * jb->out + r + k] = hsum_avx2(_mm256_add_ps(acc[k][i][0], acc[k][i][1]));
}

/* One block of the AVX2+FMA gemvs: KIND 1 bf16, MXFP4_KIND (a constant at every call site). */
static inline __attribute__((always_inline)) AVX2_FMA void
fma_block_avx2(const struct job *jb, int64_t r, int64_t m0, const int R, const int MB, const int64_t next,
               const int KIND) {
    if (KIND == MXFP4_KIND) mxfp4_fma_block_avx2(jb, r, m0, R, MB, next);
    else bf16_fma_block_avx2(jb, r, m0, R, MB, next);
}

/* Output rows r..r+R-1 for every row of x, X_BLOCK_AVX2 rows of x at a time (the last 1 or 2 apart);
   the first block prefetches the next rows. */
static inline __attribute__((always_inline)) AVX2_FMA void
fma_rows_block_avx2(const struct job *jb, int64_t r, const int R, int64_t next, const int KIND) {
    int64_t m0 = 0;
    for (; m0 + X_BLOCK_AVX2 <= jb->m; m0 += X_BLOCK_AVX2, next = -1)
        fma_block_avx2(jb, r, m0, R, X_BLOCK_AVX2, next, KIND);
    if (jb->m - m0 == 2) fma_block_avx2(jb, r, m0, R, 2, next, KIND);
    else if (jb->m - m0 == 1) fma_block_avx2(jb, r, m0, R, 1, next, KIND);
}

/* Rows r0..r1-1, R at a time (4 for one row of x, else ROW_BLOCK_AVX2_MULTI), each block prefetching
   the next; leftover rows one by one. Every pair's sums run in the same order in any block shape, so
   a result does not depend on how many rows of x share the call. */
static inline __attribute__((always_inline)) AVX2_FMA void
fma_rows_avx2(const struct job *jb, int64_t r0, int64_t r1, const int KIND) {
    int64_t r = r0;
    if (jb->m == 1)
        for (; r + ROW_BLOCK <= r1; r += ROW_BLOCK)
            fma_block_avx2(jb, r, 0, ROW_BLOCK, 1, r + 2 * ROW_BLOCK <= r1 ? r + ROW_BLOCK : -1, KIND);
    else
        for (const int R = ROW_BLOCK_AVX2_MULTI; r + R <= r1; r += R)
            fma_rows_block_avx2(jb, r, R, r + 2 * R <= r1 ? r + R : -1, KIND);
    for (; r < r1; r++) fma_rows_block_avx2(jb, r, 1, -1, KIND);
}

static AVX2_FMA void bf16_gemv_rows_avx2(const struct job *jb, int64_t r0, int64_t r1) {
    fma_rows_avx2(jb, r0, r1, 1);
}

static AVX2_FMA void mxfp4_gemv_rows_avx2(const struct job *jb, int64_t r0, int64_t r1) {
    fma_rows_avx2(jb, r0, r1, MXFP4_KIND);
}
#endif

/* The widest code the kernels may choose (cpu_kernels_limit_simd): lowered, they run the narrower
   paths on a CPU that has wider ones, which is how those paths are tested there. */
static int simd_cap = 2;

/* The widest code this CPU runs, within simd_cap: 2 AVX-512, 1 AVX2, 0 portable C only. */
static int simd_level(void) {
#ifdef KERNELS_X86
    __builtin_cpu_init();
    const int level = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
    return level < simd_cap ? level : simd_cap;
#else
    return 0;
#endif
}

static int have_avx512(void) { return simd_level() == 2; }
static int have_avx2(void) { return simd_level() >= 1; }
static int have_avx2_fma(void) {
#ifdef KERNELS_X86
    return have_avx2() && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------ int8 on the integer units */

/* int8 weights meet x as int16. Once per call each row i of x is rounded to
   q[i, k] = round(x[i, k] / x_scale[i]) with x_scale[i] = max_k |x[i, k]| / 32767, computed in double
   and rounded to nearest even, so |x - q * x_scale| <= x_scale / 2 (2^-16 of the row's largest input).
   Codes times q are then summed exactly in int32 over a group (per-row int8: over spans of INT8Q_SPAN
   inputs), each sum converted to float32 and multiplied by its group's scale, and the row's result by
   x_scale[i] (and by the row scale): y[i, r] = x_scale[i] * sum_g s[r, g] * sum_{k in g} codes[r, k] q[i, k].
   Against float32 products this is 2x fewer vector operations per weight (one widening and one integer
   dot-product instruction per 32 weights, where widening each 16 to float32 took three operations
   before the FMA), which is what kept one core below the memory's speed. Each row of x is rounded on
   its own, so a row's result never depends on the other rows of the call. A row holding inf or NaN gets
   x_scale NaN: its outputs are NaN. */
#define INT8Q_STEP 32
/* Inputs summed in int32 lanes before a conversion: each lane of an AVX-512 (AVX2) step takes 2 (4)
   products of at most 127 * 32767, so 2048 inputs keep every lane below 2^31. */
#define INT8Q_SPAN 2048
/* Blocks of output rows ahead that a block prefetches: 2 read 9216 x 2304 int8 weights from DRAM at
   21 GB/s on one core of a Zen 4 EPYC and 1024-wide ones at 17.7, against 21 / 13.4 for the next
   block (3: no faster). */
#define INT8Q_AHEAD 2
/* Rows of x per AVX-512 block (4 output rows each). */
#define INT8Q_X_BLOCK 4

static int16_t int8q_round(double v) {
    const long q = lrint(v);  /* |v| <= 32767 * (1 + 2^-52) */
    return (int16_t)(q > 32767 ? 32767 : q < -32767 ? -32767 : q);
}

/* One row of x [n] as int16 and its scale, as the comment above defines them, given a = max |x| (or
   inf / NaN when the row holds one). The conversion is portable C or, per 16 inputs, the same double
   products and round-to-nearest-even conversions in AVX-512 or AVX2 registers (the same integers:
   the scalar loop cost ~10 us a 2304-wide row, as much as a small product). */
typedef void (*round_fn)(const float *x, int64_t n, double inv, int16_t *q);

static void int8q_round_portable(const float *x, int64_t n, double inv, int16_t *q) {
    for (int64_t k = 0; k < n; k++) q[k] = int8q_round((double)x[k] * inv);
}

#ifdef KERNELS_X86
static __attribute__((target("avx512f"))) void int8q_round_avx512(const float *x, int64_t n, double inv, int16_t *q) {
    const __m512d v = _mm512_set1_pd(inv);
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        const __m256i lo = _mm512_cvtpd_epi32(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + k)), v));
        const __m256i hi = _mm512_cvtpd_epi32(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + k + 8)), v));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        _mm256_storeu_si256((__m256i *)(q + k), _mm512_cvtsepi32_epi16(both));
    }
    int8q_round_portable(x + k, n - k, inv, q + k);
}

static AVX2 void int8q_round_avx2(const float *x, int64_t n, double inv, int16_t *q) {
    const __m256d v = _mm256_set1_pd(inv);
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m128i lo = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + k)), v));
        const __m128i hi = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + k + 4)), v));
        _mm_storeu_si128((__m128i *)(q + k), _mm_packs_epi32(lo, hi));
    }
    int8q_round_portable(x + k, n - k, inv, q + k);
}
#endif

/* max |x[k]|, or inf when a value is inf or NaN; portable, AVX-512 and AVX2 (the same value). */
typedef float (*amax_fn)(const float *x, int64_t n);

static float int8q_amax_portable(const float *x, int64_t n) {
    float a = 0.0f;
    int finite = 1;
    for (int64_t k = 0; k < n; k++) {
        const float v = fabsf(x[k]);
        finite &= v <= FLT_MAX;
        a = v > a ? v : a;
    }
    return finite ? a : INFINITY;
}

#ifdef KERNELS_X86
static __attribute__((target("avx512f"))) float int8q_amax_avx512(const float *x, int64_t n) {
    __m512 a = _mm512_setzero_ps();
    const __m512 big = _mm512_set1_ps(FLT_MAX);
    __mmask16 bad = 0;
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + k));
        bad |= _mm512_cmp_ps_mask(v, big, _CMP_NLE_UQ);  /* inf or NaN */
        a = _mm512_max_ps(a, v);
    }
    const float rest = int8q_amax_portable(x + k, n - k), body = _mm512_reduce_max_ps(a);
    return bad ? INFINITY : rest > body ? rest : body;
}

static AVX2 float int8q_amax_avx2(const float *x, int64_t n) {
    __m256 a = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    const __m256 big = _mm256_set1_ps(FLT_MAX), sign = _mm256_set1_ps(-0.0f);
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, big, _CMP_NLE_UQ));
        a = _mm256_max_ps(a, v);
    }
    float lanes[8], body = 0.0f;
    _mm256_storeu_ps(lanes, a);
    for (int j = 0; j < 8; j++) body = lanes[j] > body ? lanes[j] : body;
    const float rest = int8q_amax_portable(x + k, n - k);
    return _mm256_movemask_ps(bad) ? INFINITY : rest > body ? rest : body;
}
#endif

/* The int16 rows of x [m, n] and their scales. */
static void int8q_inputs(const float *x, int64_t m, int64_t n, int16_t *q, float *scale, amax_fn amax,
                         round_fn round_row) {
    for (int64_t i = 0; i < m; i++) {
        const float *xi = x + i * n;
        int16_t *qi = q + i * n;
        const float a = amax(xi, n);
        if (!(a <= FLT_MAX) || a == 0.0f) {
            memset(qi, 0, (size_t)n * sizeof *qi);
            scale[i] = a == 0.0f ? 0.0f : NAN;
            continue;
        }
        round_row(xi, n, 32767.0 / (double)a, qi);
        scale[i] = (float)((double)a / 32767.0);
    }
}

/* Interleaved grouped int8: in each whole block of IL_BLOCK = 16 spans of 32 inputs of a row, byte
   32 s + 2 j + t holds input 32 j + 2 s + t of the block (j: the span, s: its step, t: the pair's half),
   so that one step widened to int16 puts span j's pair into lane j of a vpdpwssd, and 16 steps sum all 16
   spans in int32; inputs past the last whole block keep their order. x's rounded rows are permuted the
   same way, so codes and inputs still meet in pairs. A span lies in one group (of 32, 64 or 128 inputs:
   1, 2 or 4 spans), so lane j is scaled by its group's scale; the permutation is the same for every group
   size. The group argument of interleaved codes is minus the group size. */
#define IL_BLOCK 512
#define IL_GROUPS 16  /* spans of 32 in a block */
#define IL_MAX_GROUP 128

static inline int il_group_fits(int64_t group, int64_t n) {
    return group >= INT8Q_STEP && group <= IL_MAX_GROUP && !(group & (group - 1)) && n % group == 0;
}

/* The permutation over m rows of n elements of `elem` bytes (a constant at each call site): the pair of
   inputs 2 s, 2 s + 1 of group j and the pair 2 j, 2 j + 1 of group s trade places, so it is its own
   inverse. */
static inline __attribute__((always_inline)) void il_permute(void *rows, int64_t m, int64_t n, const size_t elem) {
    const size_t pair = 2 * elem;
    char t[IL_BLOCK * sizeof(int16_t)];
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b + IL_BLOCK <= n; b += IL_BLOCK) {
            char *v = (char *)rows + (size_t)(i * n + b) * elem;
            for (int s = 0; s < IL_GROUPS; s++)
                for (int j = 0; j < IL_GROUPS; j++) memcpy(t + (IL_GROUPS * s + j) * pair, v + (IL_GROUPS * j + s) * pair, pair);
            memcpy(v, t, IL_BLOCK * elem);
        }
}

static void il16_permute(int16_t *q, int64_t m, int64_t n) { il_permute(q, m, n, sizeof *q); }

/* Point jobs[0..count-1] (int8, x set) at their rows of x as int16, in one buffer returned to be freed
   after the call (NULL when it cannot be allocated); items with the same x (a MoE layer's gate and up
   products) share one rounding. use_simd = 0: the portable rounding (the same integers). */
static void *int8q_setup(struct job *jobs, int64_t count, int use_simd) {
    amax_fn amax = int8q_amax_portable;
    round_fn round_row = int8q_round_portable;
#ifdef KERNELS_X86
    if (use_simd && have_avx512()) amax = int8q_amax_avx512, round_row = int8q_round_avx512;
    else if (use_simd && have_avx2()) amax = int8q_amax_avx2, round_row = int8q_round_avx2;
#endif
    int64_t rows = 0, elems = 0;
    for (int64_t i = 0; i < count; i++) rows += jobs[i].m, elems += jobs[i].m * jobs[i].n;
    char *buf = malloc((size_t)(elems * (int64_t)sizeof(int16_t) + rows * (int64_t)sizeof(float)) + 1);
    if (!buf) return NULL;
    float *scale = (float *)buf;
    int16_t *q = (int16_t *)(buf + rows * (int64_t)sizeof(float));
    for (int64_t i = 0; i < count; i++) {
        struct job *jb = &jobs[i];
        int64_t same = 0;
        while (same < i && !(jobs[same].x == jb->x && jobs[same].m == jb->m && jobs[same].n == jb->n
                             && jobs[same].il16 == jb->il16)) same++;
        if (same < i) {
            jb->xq = jobs[same].xq, jb->x_scale = jobs[same].x_scale;
            continue;
        }
        int8q_inputs(jb->x, jb->m, jb->n, q, scale, amax, round_row);
        if (jb->il16) il16_permute(q, jb->m, jb->n);
        jb->xq = q, jb->x_scale = scale;
        q += jb->m * jb->n, scale += jb->m;
    }
    return buf;
}

/* The inputs summed in int32 before a conversion: a group (or the largest multiple of 32 up to
   INT8Q_SPAN dividing it), or INT8Q_SPAN for per-row int8; and the float16 scale of the span
   starting at input k of row r (per-row int8: none, 1). */
static inline int64_t int8q_span(const struct job *jb) {
    if (!jb->half_scale) return INT8Q_SPAN;
    int64_t span = jb->group <= INT8Q_SPAN ? jb->group : INT8Q_SPAN;
    while (jb->group % span) span -= INT8Q_STEP;
    return span;
}
static inline float int8q_span_scale(const struct job *jb, int64_t r, int64_t k) {
    return jb->half_scale ? half_to_float(int8_group_scale(jb, r, k)) : 1.0f;
}

/* Output rows r of every row of x: the exact int32 sums of the inputs after `body` (per-row int8 whose
   width is not a multiple of INT8Q_STEP), and the result from the sum of the rest. */
static inline float int8q_finish(const struct job *jb, int64_t r, int64_t i, int64_t body, float sum) {
    int32_t tail = 0;
    for (int64_t k = body; k < jb->n; k++) tail += (int32_t)jb->codes[r * jb->n + k] * jb->xq[i * jb->n + k];
    sum += (float)tail;
    return sum * jb->x_scale[i] * (jb->row_scale ? jb->row_scale[r] : 1.0f);
}

/* Interleaved groups (il16): each span's products summed exactly in int32, then times its group's scale. */
static void int8il_rows_portable(const struct job *jb, int64_t r0, int64_t r1) {
    const int64_t n = jb->n, groups = n / INT8Q_STEP, whole = n / IL_BLOCK * IL_GROUPS;
    const int64_t spans = jb->group / INT8Q_STEP, row_groups = n / jb->group;
    float *y = (float *)jb->y;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < jb->m; i++) {
            const int8_t *c = jb->codes + r * n;
            const int16_t *q = jb->xq + i * n;
            float sum = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                int64_t acc = 0;
                for (int e = 0; e < INT8Q_STEP; e++) {
                    /* input e of span g: in a whole block at step e / 2, lane g % 16; else in order */
                    const int64_t k = g < whole ? g / IL_GROUPS * IL_BLOCK + 32 * (e / 2) + 2 * (g % IL_GROUPS) + e % 2
                                                : g * INT8Q_STEP + e;
                    acc += (int32_t)c[k] * q[k];
                }
                sum += (float)acc * half_to_float(jb->half_scale[r * row_groups + g / spans]);
            }
            y[i * jb->out + r] = int8q_finish(jb, r, i, n, sum);
        }
}

static void int8q_rows_portable(const struct job *jb, int64_t r0, int64_t r1) {
    if (jb->il16) {
        int8il_rows_portable(jb, r0, r1);
        return;
    }
    const int64_t n = jb->n, body = n - n % INT8Q_STEP, span = int8q_span(jb);
    float *y = (float *)jb->y;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < jb->m; i++) {
            const int8_t *c = jb->codes + r * n;
            const int16_t *q = jb->xq + i * n;
            float sum = 0.0f;
            for (int64_t g0 = 0; g0 < body; g0 += span) {
                const int64_t g1 = g0 + span < body ? g0 + span : body;
                int64_t s = 0;
                for (int64_t k = g0; k < g1; k++) s += (int32_t)c[k] * q[k];
                sum += (float)s * int8q_span_scale(jb, r, g0);
            }
            y[i * jb->out + r] = int8q_finish(jb, r, i, body, sum);
        }
}

#ifdef KERNELS_X86
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma")))

/* One step's codes of rows c .. c + R - 1 (row length n) from input k0, widened to int16, after
   prefetching the next block's share of this step (next_codes, or NULL). */
static inline __attribute__((always_inline)) VNNI void
int8q_step_codes_vnni(const int8_t *c, int64_t n, int64_t k0, const int R, const char *next_codes, __m512i w[]) {
    if (next_codes) {
        _mm_prefetch(next_codes + k0 * R, _MM_HINT_T1);
        if (R * INT8Q_STEP > 64) _mm_prefetch(next_codes + k0 * R + 64, _MM_HINT_T1);
    }
    for (int k = 0; k < R; k++) w[k] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(c + k * n + k0)));
}

/* sum[k][i] = the exact int32 lanes of codes times x of rows r + k and m0 + i over inputs k0..k1-1 (whole
   steps): per step each row's 32 codes widen to int16 and one vpdpwssd per row of x adds their products. */
static inline __attribute__((always_inline)) VNNI void
int8q_sum_steps_vnni(const int8_t *c, const int16_t *q, int64_t n, int64_t k0, int64_t k1, const int R, const int MB,
                     const char *next_codes, __m512i sum[ROW_BLOCK][INT8Q_X_BLOCK]) {
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) sum[k][i] = _mm512_setzero_si512();
    for (int64_t at = k0; at < k1; at += INT8Q_STEP) {
        __m512i w[ROW_BLOCK];
        int8q_step_codes_vnni(c, n, at, R, next_codes, w);
        for (int i = 0; i < MB; i++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(q + i * n + at));
            for (int k = 0; k < R; k++) sum[k][i] = _mm512_dpwssd_epi32(sum[k][i], w[k], xv);
        }
    }
}

/* Output rows r..r+R-1 for rows m0..m0+MB-1 of x (constants at every call site). Per step each row's
   32 codes widen to int16 and one vpdpwssd per row of x adds their 32 products into 16 int32 lanes;
   at the end of a group (span) the lanes convert to float32 and one FMA applies the scale. `next`
   (>= 0): the R rows handled next, R * 32 contiguous bytes per step, prefetched into L2 as the float
   kernels do. Groups of 32 take int8g32_block_vnni below. */
static inline __attribute__((always_inline)) VNNI void
int8q_block_vnni(const struct job *jb, int64_t r, int64_t m0, const int R, const int MB, const int64_t next) {
    const int64_t n = jb->n, body = n - n % INT8Q_STEP, span = int8q_span(jb);
    const int64_t groups = jb->half_scale ? n / jb->group : 0, spans = groups ? jb->group / span : 0;
    const uint16_t *hs = groups ? jb->half_scale + r * groups : NULL;  /* the rows' scales of the group */
    int64_t spans_left = spans;
    const int8_t *c = jb->codes + r * n;
    const int16_t *q = jb->xq + m0 * n;
    const char *next_codes = next >= 0 ? (const char *)(jb->codes + next * n) : NULL;
    __m512 acc[ROW_BLOCK][INT8Q_X_BLOCK];
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) acc[k][i] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < body; g0 += span) {
        const int64_t g1 = g0 + span < body ? g0 + span : body;
        __m512i sum[ROW_BLOCK][INT8Q_X_BLOCK];
        int8q_sum_steps_vnni(c, q, n, g0, g1, R, MB, next_codes, sum);
        for (int k = 0; k < R; k++) {
            const __m512 sv = _mm512_set1_ps(groups ? _cvtsh_ss(hs[k * groups]) : 1.0f);
            for (int i = 0; i < MB; i++) acc[k][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[k][i]), sv, acc[k][i]);
        }
        if (groups && --spans_left == 0) hs++, spans_left = spans;
    }
    float *y = (float *)jb->y;
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++)
            y[(m0 + i) * jb->out + r + k] = int8q_finish(jb, r + k, m0 + i, body, _mm512_reduce_add_ps(acc[k][i]));
}

/* One group of 32 inputs from k0 for rows c.. of the codes and rows q.. of x, as Q8_0 sums it: per row of x
   and output row one vpmaddwd of the widened codes, its int32 lanes to float32, one FMA with the output
   row's scale (scale[k * stride]) into acc. */
static inline __attribute__((always_inline)) VNNI void
int8g32_step_vnni(const int8_t *c, const int16_t *q, int64_t n, int64_t k0, const int R, const int MB,
                  const char *next_codes, const float *scale, const int64_t stride,
                  __m512 acc[ROW_BLOCK][INT8Q_X_BLOCK]) {
    __m512i w[ROW_BLOCK];
    int8q_step_codes_vnni(c, n, k0, R, next_codes, w);
    for (int i = 0; i < MB; i++) {
        const __m512i xv = _mm512_loadu_si512((const void *)(q + i * n + k0));
        for (int k = 0; k < R; k++)
            acc[k][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(w[k], xv)),
                                        _mm512_set1_ps(scale[k * stride]), acc[k][i]);
    }
}

/* int8q_block_vnni for groups of 32 (Q8_0's layout, the default int8 store), with the same operations
   in the same order, so the same bits: each step is one group, its 32 products summed by one vpmaddwd
   (the int32 sum of a step starts at 0) and added to the float lanes by one FMA with the group's
   scale. The rows' float16 scales are widened 16 groups at a time into a table before the steps that
   use them, so a step's scale is one broadcast from L1. Written apart from the general block because
   its counters and per-group scale loads did not fit the registers there: the compiled loop kept
   them on the stack and ran one core at ~21 GB/s of weights in cache, against ~39 for per-row int8. */
static inline __attribute__((always_inline)) VNNI void
int8g32_block_vnni(const struct job *jb, int64_t r, int64_t m0, const int R, const int MB, const int64_t next) {
    const int64_t n = jb->n, groups = n / INT8Q_STEP;  /* n is whole groups (checked by the callers) */
    const uint16_t *hs = jb->half_scale + r * groups;
    const int8_t *c = jb->codes + r * n;
    const int16_t *q = jb->xq + m0 * n;
    const char *next_codes = next >= 0 ? (const char *)(jb->codes + next * n) : NULL;
    __m512 acc[ROW_BLOCK][INT8Q_X_BLOCK];
    float sc[ROW_BLOCK][16] __attribute__((aligned(64)));
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) acc[k][i] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        const int64_t steps = groups - g0 < 16 ? groups - g0 : 16;
        for (int k = 0; k < R; k++) {
            if (steps == 16)
                _mm512_store_ps(sc[k], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hs + k * groups + g0))));
            else
                for (int64_t j = 0; j < steps; j++) sc[k][j] = _cvtsh_ss(hs[k * groups + g0 + j]);
        }
        for (int64_t j = 0; j < steps; j++)
            int8g32_step_vnni(c, q, n, (g0 + j) * INT8Q_STEP, R, MB, next_codes, &sc[0][j], 16, acc);
    }
    float *y = (float *)jb->y;
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++)
            y[(m0 + i) * jb->out + r + k] = int8q_finish(jb, r + k, m0 + i, n, _mm512_reduce_add_ps(acc[k][i]));
}

/* The 16 lanes' scales of a whole interleaved block whose first group's float16 scale is at h: for groups
   of G = 32 the block's 16 scales, of 64 its 8 and of 128 its 4, each repeated for its G / 32 spans (only
   the block's own scales are read). */
static inline __attribute__((always_inline)) VNNI __m512 il_scales_vnni(const uint16_t *h, const int G) {
    if (G == 32) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
    if (G == 64)
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                     _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)h))));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_loadl_epi64((const __m128i *)h))));
}

/* Interleaved groups of G (il16; G = jb->group, a constant at each call site) for output rows r..r+R-1
   and rows m0..m0+MB-1 of x (MB <= 2: an int32 and a float accumulator per pair): per whole block 16
   steps of one widening per row and one vpdpwssd per row and row of x, then one conversion and one FMA
   with the block's 16 lane scales; the spans past the last whole block one int8g32_step_vnni each, as
   int8g32_block_vnni takes them, with their group's scale. */
static inline __attribute__((always_inline)) VNNI void
int8il_block_vnni(const struct job *jb, int64_t r, int64_t m0, const int R, const int MB, const int64_t next,
                  const int G) {
    const int64_t n = jb->n, groups = n / G, blocks_end = n / IL_BLOCK * IL_BLOCK;
    const uint16_t *hs = jb->half_scale + r * groups;
    const int8_t *c = jb->codes + r * n;
    const int16_t *q = jb->xq + m0 * n;
    const char *next_codes = next >= 0 ? (const char *)(jb->codes + next * n) : NULL;
    __m512 acc[ROW_BLOCK][INT8Q_X_BLOCK];
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) acc[k][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks_end; b += IL_BLOCK) {
        __m512i sum[ROW_BLOCK][INT8Q_X_BLOCK];
        int8q_sum_steps_vnni(c, q, n, b, b + IL_BLOCK, R, MB, next_codes, sum);
        for (int k = 0; k < R; k++) {
            const __m512 sv = il_scales_vnni(hs + k * groups + b / G, G);
            for (int i = 0; i < MB; i++) acc[k][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[k][i]), sv, acc[k][i]);
        }
    }
    for (int64_t k0 = blocks_end; k0 < n; k0 += INT8Q_STEP) {
        float sc[ROW_BLOCK];
        for (int k = 0; k < R; k++) sc[k] = _cvtsh_ss(hs[k * groups + k0 / G]);
        int8g32_step_vnni(c, q, n, k0, R, MB, next_codes, sc, 1, acc);
    }
    float *y = (float *)jb->y;
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++)
            y[(m0 + i) * jb->out + r + k] = int8q_finish(jb, r + k, m0 + i, n, _mm512_reduce_add_ps(acc[k][i]));
}

static inline __attribute__((always_inline)) VNNI void
int8il_x_rows_vnni(const struct job *jb, int64_t r, const int R, int64_t next, const int G) {
    int64_t m0 = 0;
    for (; m0 + 2 <= jb->m; m0 += 2, next = -1) int8il_block_vnni(jb, r, m0, R, 2, next, G);
    if (m0 < jb->m) int8il_block_vnni(jb, r, m0, R, 1, next, G);
}

static inline __attribute__((always_inline)) VNNI void
int8il_rows_vnni_g(const struct job *jb, int64_t r0, int64_t r1, const int G) {
    int64_t r = r0;
    for (; r + ROW_BLOCK <= r1; r += ROW_BLOCK)
        int8il_x_rows_vnni(jb, r, ROW_BLOCK, r + (INT8Q_AHEAD + 1) * ROW_BLOCK <= r1 ? r + INT8Q_AHEAD * ROW_BLOCK : -1,
                           G);
    for (; r < r1; r++) int8il_x_rows_vnni(jb, r, 1, -1, G);
}

static VNNI void int8il_rows_vnni(const struct job *jb, int64_t r0, int64_t r1) {
    if (jb->group == 32) int8il_rows_vnni_g(jb, r0, r1, 32);
    else if (jb->group == 64) int8il_rows_vnni_g(jb, r0, r1, 64);
    else int8il_rows_vnni_g(jb, r0, r1, 128);
}

/* Every row of x for output rows r..r+R-1, INT8Q_X_BLOCK rows of x at a time; the first block
   prefetches `next`. */
static inline __attribute__((always_inline)) VNNI void
int8q_x_rows_vnni(const struct job *jb, int64_t r, const int R, int64_t next, const int G32) {
#define INT8Q_BLOCK(MB) (G32 ? int8g32_block_vnni(jb, r, m0, R, MB, next) : int8q_block_vnni(jb, r, m0, R, MB, next))
    int64_t m0 = 0;
    for (; m0 + INT8Q_X_BLOCK <= jb->m; m0 += INT8Q_X_BLOCK, next = -1) INT8Q_BLOCK(INT8Q_X_BLOCK);
    switch (jb->m - m0) {
    case 3: INT8Q_BLOCK(3); break;
    case 2: INT8Q_BLOCK(2); break;
    case 1: INT8Q_BLOCK(1); break;
    default: break;
    }
#undef INT8Q_BLOCK
}

static inline __attribute__((always_inline)) VNNI void
int8q_rows_vnni_g(const struct job *jb, int64_t r0, int64_t r1, const int G32) {
    int64_t r = r0;
    for (; r + ROW_BLOCK <= r1; r += ROW_BLOCK)
        int8q_x_rows_vnni(jb, r, ROW_BLOCK, r + (INT8Q_AHEAD + 1) * ROW_BLOCK <= r1 ? r + INT8Q_AHEAD * ROW_BLOCK : -1,
                          G32);
    for (; r < r1; r++) int8q_x_rows_vnni(jb, r, 1, -1, G32);
}

static VNNI void int8q_rows_vnni(const struct job *jb, int64_t r0, int64_t r1) {
    if (jb->il16) int8il_rows_vnni(jb, r0, r1);
    else if (jb->half_scale && jb->group == INT8Q_STEP) int8q_rows_vnni_g(jb, r0, r1, 1);
    else int8q_rows_vnni_g(jb, r0, r1, 0);
}

/* The AVX2 counterpart (also for AVX-512 without VNNI): two widenings of 16 codes and two vpmaddwd per
   32 weights and row of x, their 8-lane sums added in int32. One row of x: 4 output rows; more: 2 output
   rows x 2 rows of x, within the 16 registers. */
static inline __attribute__((always_inline)) AVX2_FMA void
int8q_block_avx2(const struct job *jb, int64_t r, int64_t m0, const int R, const int MB, const int64_t next) {
    const int64_t n = jb->n, body = n - n % INT8Q_STEP, span = int8q_span(jb);
    const int64_t groups = jb->half_scale ? n / jb->group : 0, spans = groups ? jb->group / span : 0;
    const uint16_t *hs = groups ? jb->half_scale + r * groups : NULL;  /* the rows' scales of the group */
    int64_t spans_left = spans;
    const int8_t *c = jb->codes + r * n;
    const int16_t *q = jb->xq + m0 * n;
    const char *next_codes = next >= 0 ? (const char *)(jb->codes + next * n) : NULL;
    __m256 acc[ROW_BLOCK][2];
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++) acc[k][i] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < body; g0 += span) {
        const int64_t g1 = g0 + span < body ? g0 + span : body;
        __m256i sum[ROW_BLOCK][2];
        for (int k = 0; k < R; k++)
            for (int i = 0; i < MB; i++) sum[k][i] = _mm256_setzero_si256();
        for (int64_t k0 = g0; k0 < g1; k0 += INT8Q_STEP) {
            if (next_codes) {
                _mm_prefetch(next_codes + k0 * R, _MM_HINT_T1);
                if (R * INT8Q_STEP > 64) _mm_prefetch(next_codes + k0 * R + 64, _MM_HINT_T1);
            }
            for (int k = 0; k < R; k++) {
                const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + k * n + k0)));
                const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + k * n + k0 + 16)));
                for (int i = 0; i < MB; i++) {
                    const __m256i *qi = (const __m256i *)(q + i * n + k0);
                    const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(qi)),
                                                       _mm256_madd_epi16(hi, _mm256_loadu_si256(qi + 1)));
                    sum[k][i] = _mm256_add_epi32(sum[k][i], d);
                }
            }
        }
        for (int k = 0; k < R; k++) {
            const __m256 sv = _mm256_set1_ps(groups ? _cvtsh_ss(hs[k * groups]) : 1.0f);
            for (int i = 0; i < MB; i++) acc[k][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[k][i]), sv, acc[k][i]);
        }
        if (groups && --spans_left == 0) hs++, spans_left = spans;
    }
    float *y = (float *)jb->y;
    for (int k = 0; k < R; k++)
        for (int i = 0; i < MB; i++)
            y[(m0 + i) * jb->out + r + k] = int8q_finish(jb, r + k, m0 + i, body, hsum_avx2(acc[k][i]));
}

/* The scales of lanes 8 half .. 8 half + 7 (spans of 32) of a whole interleaved block whose first group's
   float16 scale is at h, for groups of g = 32, 64 or 128 (il_scales_vnni's 16 lanes, in two halves). */
static inline AVX2_FMA __m256 il_scales_avx2(const uint16_t *h, int64_t g, int half) {
    if (g == 32) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8 * half)));
    int32_t bits[2];
    memcpy(bits, h + (g == 64 ? 4 : 2) * half, g == 64 ? 8 : 4);
    const __m128 v = _mm_cvtph_ps(g == 64 ? _mm_loadl_epi64((const __m128i *)bits) : _mm_cvtsi32_si128(bits[0]));
    const __m256i idx = g == 64 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3) : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), idx);
}

/* Interleaved groups (il16) on AVX2, one output row and one row of x: a step's first 16 codes are
   spans 0-7's pair (8 lanes of a vpmaddwd), the next 16 spans 8-15's; each block's two int32 sums are
   converted and scaled once. The spans past the last whole block take one product a span. */
static AVX2_FMA void int8il_rows_avx2(const struct job *jb, int64_t r0, int64_t r1) {
    const int64_t n = jb->n, g = jb->group, groups = n / g, blocks_end = n / IL_BLOCK * IL_BLOCK;
    float *y = (float *)jb->y;
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *c = jb->codes + r * n;
        const uint16_t *hs = jb->half_scale + r * groups;
        for (int64_t i = 0; i < jb->m; i++) {
            const int16_t *q = jb->xq + i * n;
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            for (int64_t b = 0; b < blocks_end; b += IL_BLOCK) {
                __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
                for (int64_t k0 = b; k0 < b + IL_BLOCK; k0 += INT8Q_STEP) {
                    const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + k0)));
                    const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + k0 + 16)));
                    s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)(q + k0))));
                    s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + k0 + 16))));
                }
                acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), il_scales_avx2(hs + b / g, g, 0), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), il_scales_avx2(hs + b / g, g, 1), acc1);
            }
            for (int64_t k0 = blocks_end; k0 < n; k0 += INT8Q_STEP) {
                const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + k0)));
                const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + k0 + 16)));
                const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)(q + k0))),
                                                   _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + k0 + 16))));
                acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(_cvtsh_ss(hs[k0 / g])), acc0);
            }
            y[i * jb->out + r] = int8q_finish(jb, r, i, n, hsum_avx2(_mm256_add_ps(acc0, acc1)));
        }
    }
}

static AVX2_FMA void int8q_rows_avx2(const struct job *jb, int64_t r0, int64_t r1) {
    if (jb->il16) {
        int8il_rows_avx2(jb, r0, r1);
        return;
    }
    int64_t r = r0;
    if (jb->m == 1)
        for (; r + ROW_BLOCK <= r1; r += ROW_BLOCK)
            int8q_block_avx2(jb, r, 0, ROW_BLOCK, 1,
                             r + (INT8Q_AHEAD + 1) * ROW_BLOCK <= r1 ? r + INT8Q_AHEAD * ROW_BLOCK : -1);
    for (; r + 2 <= r1; r += 2) {
        int64_t m0 = 0, next = r + 4 <= r1 ? r + 2 : -1;
        for (; m0 + 2 <= jb->m; m0 += 2, next = -1) int8q_block_avx2(jb, r, m0, 2, 2, next);
        if (m0 < jb->m) int8q_block_avx2(jb, r, m0, 2, 1, next);
    }
    for (; r < r1; r++)
        for (int64_t i = 0; i < jb->m; i++) int8q_block_avx2(jb, r, i, 1, 1, -1);
}
#endif

static int have_vnni(void) {
#ifdef KERNELS_X86
    return have_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

static rows_fn int8q_rows_fn(int use_simd) {
#ifdef KERNELS_X86
    if (use_simd && have_vnni()) return int8q_rows_vnni;
    if (use_simd && have_avx2_fma()) return int8q_rows_avx2;
#endif
    (void)use_simd;
    return int8q_rows_portable;
}

/* ------------------------------------------------------------------ threads */

/* Work is handed to threads that are started once and then woken for each call: a decode token
   makes hundreds of products, and starting (and joining) a thread per product cost 20-80 us each,
   as much as a small product itself. One caller at a time uses the pool; a second caller that
   finds it busy (two Python threads in kernels at once) starts its own threads as before. */
typedef void *(*task_fn)(void *);

#define POOL_MAX 63  /* workers beside the caller */

static struct {
    pthread_mutex_t busy;  /* held by the caller using the pool for the whole of its call */
    pthread_mutex_t m;
    pthread_cond_t wake, done;
    int workers;           /* started so far (started lazily, never stopped) */
    unsigned long call;    /* bumped for every call; a worker runs once per new value */
    int tasks;             /* workers 1..tasks-1 have a task in this call */
    int pending;           /* tasks of this call not finished yet */
    task_fn fn;
    char *args;
    size_t size;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER};

/* A decode token's products follow each other tens to hundreds of microseconds apart (the model's
   small ops run between them): a worker that slept after each call needed a futex wake and a
   context switch to start the next, and the caller the same to learn a call was done. Both first
   watch the shared counter for up to SPIN_NS, then sleep as before. */
#define SPIN_NS 200000

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Wait (without the lock) while *v == old, for at most SPIN_NS; whether it changed. */
static int spin_while_ulong(const unsigned long *v, unsigned long old) {
    const int64_t end = now_ns() + SPIN_NS;
    for (int i = 0;; i++) {
        if (__atomic_load_n(v, __ATOMIC_ACQUIRE) != old) return 1;
        cpu_relax();
        if ((i & 255) == 255 && now_ns() > end) return 0;
    }
}

static int spin_while_positive(const int *v) {
    const int64_t end = now_ns() + SPIN_NS;
    for (int i = 0;; i++) {
        if (__atomic_load_n(v, __ATOMIC_ACQUIRE) <= 0) return 1;
        cpu_relax();
        if ((i & 255) == 255 && now_ns() > end) return 0;
    }
}

static void *pool_worker(void *arg) {
    const int me = (int)(intptr_t)arg;  /* task index, 1.. */
    unsigned long seen = 0;
    for (;;) {
        spin_while_ulong(&pool.call, seen);
        pthread_mutex_lock(&pool.m);
        while (pool.call == seen || me >= pool.tasks) {
            seen = pool.call;
            pthread_cond_wait(&pool.wake, &pool.m);
        }
        seen = pool.call;
        task_fn fn = pool.fn;
        void *a = pool.args + (size_t)me * pool.size;
        pthread_mutex_unlock(&pool.m);
        fn(a);
        pthread_mutex_lock(&pool.m);
        if (__atomic_sub_fetch(&pool.pending, 1, __ATOMIC_RELEASE) == 0) pthread_cond_signal(&pool.done);
        pthread_mutex_unlock(&pool.m);
    }
    return NULL;
}

/* After fork() only the forking thread exists in the child: forget the workers (and any call). */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.m, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.workers = 0, pool.call = 0, pool.tasks = 0, pool.pending = 0;
}

/* Fallback: one thread started per task, joined at the end; a task whose thread cannot be
   started runs here, so the result never depends on threads starting. */
static void run_spawned(task_fn fn, char *args, size_t size, int t) {
    pthread_t *tid = malloc((size_t)t * sizeof *tid);
    int *started = calloc((size_t)t, sizeof *started);
    for (int i = 1; i < t; i++)
        if (tid && started) started[i] = pthread_create(&tid[i], NULL, fn, args + (size_t)i * size) == 0;
    fn(args);
    for (int i = 1; i < t; i++) {
        if (started && started[i]) pthread_join(tid[i], NULL);
        else fn(args + (size_t)i * size);
    }
    free(tid), free(started);
}

static void pool_register_fork(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Run fn(args + i * size) for i in 0..t-1 at once; the calling thread runs i = 0 (size 0: every
   task gets the same argument). Returns when all are done. */
static void run_parallel(task_fn fn, void *args, size_t size, int t) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (t <= 1) {
        fn(args);
        return;
    }
    pthread_once(&once, pool_register_fork);
    if (t - 1 > POOL_MAX || pthread_mutex_trylock(&pool.busy) != 0) {
        run_spawned(fn, args, size, t);
        return;
    }
    pthread_mutex_lock(&pool.m);
    pthread_t tid;
    while (pool.workers < t - 1 && pthread_create(&tid, NULL, pool_worker, (void *)(intptr_t)(pool.workers + 1)) == 0) {
        pthread_detach(tid);
        pool.workers++;
    }
    const int ready = t - 1 < pool.workers ? t : pool.workers + 1;  /* tasks the pool can take */
    pool.fn = fn, pool.args = args, pool.size = size;
    pool.tasks = ready, pool.pending = ready - 1;
    __atomic_add_fetch(&pool.call, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.m);
    fn(args);
    for (int i = ready; i < t; i++) fn((char *)args + (size_t)i * size);  /* workers that could not start */
    spin_while_positive(&pool.pending);
    pthread_mutex_lock(&pool.m);
    while (pool.pending > 0) pthread_cond_wait(&pool.done, &pool.m);
    pool.tasks = 0;
    pthread_mutex_unlock(&pool.m);
    pthread_mutex_unlock(&pool.busy);
}

/* Rows 0..out-1 of every job (its own out: jobs of one call may differ), handed out in chunks that the
   threads claim as they come free: a thread that starts late (woken late, or sharing its core with
   another process) takes fewer chunks, and no thread waits at the end for another's fixed share. A
   chunk is `chunk` rows (a multiple of the kernel's block); a row's result never depends on the chunk
   it falls in. */
struct row_chunks {
    const struct job *jobs;
    rows_fn fn;
    int64_t chunk, per_job, total;
    int64_t next;  /* the next chunk to claim (atomic) */
};

static void *run_row_chunks(void *arg) {
    struct row_chunks *rc = (struct row_chunks *)arg;
    for (;;) {
        const int64_t i = __atomic_fetch_add(&rc->next, 1, __ATOMIC_RELAXED);
        if (i >= rc->total) break;
        const struct job *jb = &rc->jobs[i / rc->per_job];
        const int64_t r0 = (i % rc->per_job) * rc->chunk;
        if (r0 < jb->out) rc->fn(jb, r0, r0 + rc->chunk < jb->out ? r0 + rc->chunk : jb->out);
    }
    return NULL;
}

/* Run fn over rows 0..out-1 of each of `count` jobs (out: the largest job's) on up to `threads`
   threads (fewer when there are fewer than MIN_WEIGHTS_PER_THREAD weight-rows of work each);
   `weights` is the call's total (weights x rows of x), `align` the rows a chunk is a multiple of.
   Returns 0. */
static int run_chunked(const struct job *jobs, int64_t count, rows_fn fn, int64_t out, int64_t weights,
                       int64_t align, int threads) {
    int64_t t = threads, by_size = weights / MIN_WEIGHTS_PER_THREAD, by_rows = count * ((out + align - 1) / align);
    if (t > by_size) t = by_size;
    if (t > by_rows) t = by_rows;
    if (t <= 1) {
        for (int64_t i = 0; i < count; i++) fn(&jobs[i], 0, jobs[i].out);
        return 0;
    }
    /* One job: about four chunks per thread, even shares, while most rows still have the kernels'
       prefetch of the rows after them. Several jobs (a MoE layer's experts) share out by their number:
       a chunk per thread and job, because every chunk starts its rows' stream from DRAM cold (a decode
       MoE call of 9 experts, 57 MB: 27.9-28.6 GB/s this way against 26.9-27.2 at four). And no chunk
       under MIN_CHUNK_WEIGHTS (a job's whole rows when it is smaller), so many small jobs (an attention
       layer's 32 heads of 128 x 512) go to the threads whole instead of in 16-row pieces. */
    const int64_t per_thread = count > 1 ? 1 : 4;
    int64_t want = (out + per_thread * t - 1) / (per_thread * t);
    const int64_t per_out = weights / (count * out > 0 ? count * out : 1);
    const int64_t least = MIN_CHUNK_WEIGHTS / (per_out > 0 ? per_out : 1);
    if (want < least) want = least < out ? least : out;
    const int64_t chunk = (want + align - 1) / align * align;
    struct row_chunks rc = {jobs, fn, chunk, (out + chunk - 1) / chunk, 0, 0};
    rc.total = count * rc.per_job;
    run_parallel(run_row_chunks, &rc, 0, (int)t);
    return 0;
}

static int run_rows(const struct job *jb, rows_fn fn, int threads) {
    return run_chunked(jb, 1, fn, jb->out, jb->out * jb->n * (jb->m > 0 ? jb->m : 1), ROW_BLOCK, threads);
}

/* The E8M0 byte -> factor table, filled once (it was filled per call: 256 entries for every
   expert of a batched MoE layer, whose products are small). */
static float factor_table[256];
static void fill_factor_table(void) {
    for (unsigned s = 0; s < 256; s++) factor_table[s] = e8m0_factor(s);
}
static const float *e8m0_factors(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, fill_factor_table);
    return factor_table;
}

/* ------------------------------------------------------------------ exported */

/* Grouped int8 codes [out, n] (whole spans of 32) turned between the plain and the interleaved layout in
   place (the permutation of each whole IL_BLOCK of a row is its own inverse, and the same for every group
   size). Returns 0, -2 when n is not whole spans of 32. */
int int8_interleave_inplace(int8_t *codes, int64_t out, int64_t n) {
    if (n % INT8Q_STEP || out < 0) return -2;
    il_permute(codes, out, n, sizeof *codes);
    return 0;
}

int cpu_kernels_abi(void) { return KERNELS_ABI; }

/* The widest code the gemvs run here: 2 AVX-512, 1 AVX2 (int8, bf16, MXFP4; the others portable), 0 portable. */
int cpu_kernels_simd(void) { return simd_level(); }

/* Sets the widest code the kernels may choose (0, 1, 2 as cpu_kernels_simd counts; clamped) for the
   calls that start after it; returns the previous limit. */
int cpu_kernels_limit_simd(int level) {
    const int previous = simd_cap;
    simd_cap = level < 0 ? 0 : level > 2 ? 2 : level;
    return previous;
}

/* The MXFP4 gemv's rows function for this CPU, with the m rows of x put into jb in the layout it
   reads (x as given; split into even and odd inputs for AVX-512; the lanes' order for AVX2). *scratch
   is the copy made for it (NULL: none), to be freed after the call. NULL when it cannot be allocated. */
static rows_fn mxfp4_setup(struct job *jb, const float *x, int64_t m, int64_t n, int use_simd, float **scratch) {
    jb->x = x;
    jb->factor = e8m0_factors();
    *scratch = NULL;
#ifdef KERNELS_X86
    const int avx512 = use_simd && have_avx512(), avx2 = use_simd && !avx512 && have_avx2_fma();
    if (avx512 || avx2) {
        float *xs = malloc((size_t)(m * n > 0 ? m * n : 1) * sizeof *xs);
        if (!xs) return NULL;
        *scratch = xs;
        if (avx2) {
            mxfp4_lanes_avx2(x, m, n, xs);
            jb->x = xs;
            return mxfp4_gemv_rows_avx2;
        }
        /* De-interleaved once per call so that each decoded half of a group meets its inputs. */
        const int64_t half = n / 2;
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < half; j++) {
                xs[i * half + j] = x[i * n + 2 * j];
                xs[(m + i) * half + j] = x[i * n + 2 * j + 1];
            }
        jb->x_even = xs;
        jb->x_odd = xs + m * half;
        return mxfp4_gemv_rows_avx512;
    }
#endif
    (void)use_simd;
    return mxfp4_gemv_rows_portable;
}

/* MXFP4: y [m, out] = x [m, n] @ W^T. use_simd = 0 forces the portable code.
   Returns 0, or -1 when scratch memory cannot be allocated. */
int mxfp4_gemv_f32(const float *x, int64_t m, const uint8_t *packed, const uint8_t *scale,
                   int64_t out, int64_t n, float *y, int threads, int use_simd) {
    struct job jb = {.packed = packed, .scale = scale, .y = y, .m = m, .out = out, .n = n};
    float *scratch;
    const rows_fn fn = mxfp4_setup(&jb, x, m, n, use_simd, &scratch);
    if (!fn) return -1;
    const int rc = run_rows(&jb, fn, threads);
    free(scratch);
    return rc;
}

/* Many MXFP4 products of one weight shape in one call (a MoE layer's routed experts for a batch):
   item i computes y[y_row[i] : y_row[i] + m[i]] = x[x_row[i] : x_row[i] + m[i]] @ W_i^T, where
   x is [*, n] and y [*, out]. Each item is computed exactly as mxfp4_gemv_f32 computes it alone;
   x is laid out for the kernel once for all items, whose rows the threads share out in chunks
   (as for the dense items). Returns 0, or -1 when scratch memory cannot be allocated. */
int mxfp4_gemv_items_f32(const float *x, const uint8_t *const *packed, const uint8_t *const *scale,
                         const int64_t *x_row, const int64_t *y_row, const int64_t *m, int64_t count,
                         int64_t out, int64_t n, float *y, int threads, int use_simd) {
    int64_t rows = 0, weights = 0;
    for (int64_t i = 0; i < count; i++) {
        if (x_row[i] + m[i] > rows) rows = x_row[i] + m[i];
        weights += out * n * (m[i] > 0 ? m[i] : 1);
    }
    struct job base = {.out = out, .n = n};
    float *scratch;
    const rows_fn fn = mxfp4_setup(&base, x, rows, n, use_simd, &scratch);
    struct job *jobs = fn ? malloc((size_t)(count > 0 ? count : 1) * sizeof *jobs) : NULL;
    if (!jobs) {
        free(scratch);
        return -1;
    }
    for (int64_t i = 0; i < count; i++) {
        jobs[i] = base;
        jobs[i].packed = packed[i], jobs[i].scale = scale[i], jobs[i].m = m[i], jobs[i].y = y + y_row[i] * out;
        jobs[i].x = base.x + x_row[i] * n;
        if (base.x_even) jobs[i].x_even = base.x_even + x_row[i] * (n / 2), jobs[i].x_odd = base.x_odd + x_row[i] * (n / 2);
    }
    const int rc = run_chunked(jobs, count, fn, out, weights, ROW_BLOCK, threads);
    free(jobs);
    free(scratch);
    return rc;
}

/* MXFP4: w [out, n] = W as float32 (kind 0) or bfloat16 bits (kind 1). */
int mxfp4_dequant(const uint8_t *packed, const uint8_t *scale, int64_t out, int64_t n, void *w,
                  int kind, int threads, int use_simd) {
    struct job jb = {.packed = packed, .scale = scale, .y = w, .m = 1, .out = out, .n = n, .kind = kind,
                     .factor = e8m0_factors()};
    if (kind != OUT_F32 && kind != OUT_BF16) return -2;
    rows_fn fn = mxfp4_dequant_rows_portable;
#ifdef KERNELS_X86
    if (use_simd && have_avx512()) fn = mxfp4_dequant_rows_avx512;
#endif
    (void)use_simd;
    return run_rows(&jb, fn, threads);
}

/* A group argument the int8 products take for rows of n inputs: 0 (row scales), a multiple of 32 dividing
   n, or minus a group of 32, 64 or 128 dividing n with the codes interleaved (not for the transposed
   products, which read columns). */
static int int8_group_fits(int64_t group, int64_t n) {
    if (group < 0) return il_group_fits(-group, n);
    return !group || (group % 32 == 0 && n % group == 0);
}

/* Point a job at int8 scales: float32 row scales (group 0), float16 bits per group of `group`, or per group
   of -group with the codes interleaved (group < 0). */
static void int8_scales(struct job *jb, const void *scale, int64_t group) {
    if (group < 0) jb->half_scale = (const uint16_t *)scale, jb->group = -group, jb->il16 = 1;
    else if (group) jb->half_scale = (const uint16_t *)scale, jb->group = group;
    else jb->row_scale = (const float *)scale;
}

static rows_fn dense_rows_fn(int is_int8, int use_simd) {
    if (is_int8) return int8q_rows_fn(use_simd);
#ifdef KERNELS_X86
    if (use_simd && have_avx512()) return bf16_gemv_rows_avx512;
    if (use_simd && have_avx2_fma()) return bf16_gemv_rows_avx2;
    if (use_simd && have_avx2()) return dense_gemv_rows_avx2;
#endif
    (void)use_simd;
    return dense_gemv_rows_portable;
}

/* One dense product's job: int8 codes w with their scales, or bf16 bits (is_int8 = 0); *weights grows
   by its work (weights x rows of x). */
static struct job dense_job(const float *x, int64_t m, const void *w, const void *scale, float *y, int64_t out,
                            int64_t n, int is_int8, int64_t group, int64_t *weights) {
    struct job jb = {.x = x, .y = y, .m = m, .out = out, .n = n};
    if (is_int8) jb.codes = (const int8_t *)w, int8_scales(&jb, scale, group);
    else jb.bf16 = (const uint16_t *)w;
    *weights += out * n * (m > 0 ? m : 1);
    return jb;
}

/* Run `count` dense jobs over all their rows (out: the largest job's), int8 ones on their rows of x
   rounded first. Returns 0, or -1 when out of memory. */
static int run_dense(struct job *jobs, int64_t count, int is_int8, int64_t out, int64_t weights, int threads,
                     int use_simd) {
    void *inputs = is_int8 ? int8q_setup(jobs, count, use_simd) : NULL;
    if (is_int8 && !inputs) return -1;
    const int rc = run_chunked(jobs, count, dense_rows_fn(is_int8, use_simd), out, weights, ROW_BLOCK, threads);
    free(inputs);
    return rc;
}

/* int8: y [m, out] = x [m, n] @ W^T, y[i, r] = scale[r] * sum_k codes[r, k] * x[i, k] (group 0),
   or sum_k codes[r, k] * scale[r, k / group] * x[i, k] (grouped; group a multiple of 32 dividing n).
   use_simd = 0 forces the portable code. Returns 0, -2 for a group that does not fit. */
int int8_gemv_f32(const float *x, int64_t m, const int8_t *codes, const void *scale,
                  int64_t out, int64_t n, int64_t group, float *y, int threads, int use_simd) {
    if (!int8_group_fits(group, n)) return -2;
    int64_t weights = 0;
    struct job jb = dense_job(x, m, codes, scale, y, out, n, 1, group, &weights);
    return run_dense(&jb, 1, 1, out, weights, threads, use_simd);
}

/* int4 (bits 4) or int6 (bits 6): y [m, out] = x [m, n] @ W^T,
   y[i, r] = sum over groups g of sum_{k in g} (u[r, k] - offset) * scale[r, g] * x[i, k], with
   scale given as float16 bits [out, n/group]. use_simd = 0 forces the portable code.
   Returns 0, -1 when scratch memory cannot be allocated, -2 for an unsupported layout. */
int intq_gemv_f32(const float *x, int64_t m, const uint8_t *packed, const uint16_t *scale,
                  int64_t out, int64_t n, int64_t group, int bits, float *y, int threads, int use_simd) {
    if ((bits != 4 && bits != 6) || group <= 0 || group % INTQ_UNIT || n % group) return -2;
    struct job jb = {.x = x, .packed = packed, .half_scale = scale, .y = y, .m = m, .out = out,
                     .n = n, .group = group, .bits = bits};
    rows_fn fn = intq_gemv_rows_portable;
    float *xs = NULL;
    int32_t *lanes = NULL;
#ifdef KERNELS_X86
    if (use_simd && have_avx512()) {
        /* x is copied once per call, padded with zeros to whole steps: de-interleaved for int4
           (so that each decoded half of a step meets its inputs), in order for int6. */
        const int64_t E = bits == 4 ? INT4_STEP : INT6_STEP, steps = (n + E - 1) / E;
        const int64_t stride = bits == 4 ? steps * 16 : steps * INT6_STEP;
        const int64_t copies = bits == 4 ? 2 : 1;
        xs = calloc((size_t)(copies * m * stride), sizeof *xs);
        if (!xs) return -1;
        for (int64_t i = 0; i < m; i++)
            for (int64_t k = 0; k < n; k++) {
                if (bits == 6) xs[i * stride + k] = x[i * n + k];
                else xs[((k & 1) * m + i) * stride + k / 2] = x[i * n + k];
            }
        if (group % E) {
            /* Steps straddle groups: each lane's group, from the step's first one; lanes past the
               row's end point at the zero after the row's scales. */
            const int64_t groups = n / group;
            lanes = malloc((size_t)(steps * 16) * sizeof *lanes);
            if (!lanes) {
                free(xs);
                return -1;
            }
            for (int64_t c = 0; c < steps; c++)
                for (int64_t j = 0; j < 16; j++) {
                    const int64_t k = c * E + (bits == 4 ? 2 * j : j), g0 = c * E / group;
                    lanes[c * 16 + j] = (int32_t)((k < n ? k / group : groups) - g0);
                }
        }
        jb.x_even = xs;
        jb.x_odd = xs + m * stride;
        jb.x_stride = stride;
        jb.steps = steps;
        jb.lane_group = lanes;
        fn = bits == 4 ? int4_gemv_rows_avx512 : int6_gemv_rows_avx512;
    }
#endif
    (void)use_simd;
    int rc = run_rows(&jb, fn, threads);
    free(xs);
    free(lanes);
    return rc;
}

/* bf16: y [m, out] = x [m, n] @ W^T, W given as bf16 bits [out, n], summed in float32.
   use_simd = 0 forces the portable code. Returns 0. */
int bf16_gemv_f32(const float *x, int64_t m, const uint16_t *w, int64_t out, int64_t n, float *y,
                  int threads, int use_simd) {
    struct job jb = {.x = x, .bf16 = w, .y = y, .m = m, .out = out, .n = n};
    rows_fn fn = dense_gemv_rows_portable;
#ifdef KERNELS_X86
    if (use_simd && have_avx512()) fn = bf16_gemv_rows_avx512;
    else if (use_simd && have_avx2_fma()) fn = bf16_gemv_rows_avx2;
    else if (use_simd && have_avx2()) fn = dense_gemv_rows_avx2;
#endif
    (void)use_simd;
    return run_rows(&jb, fn, threads);
}

/* ------------------------------------------------------------------ many dense products */

/* Fill jobs[i] for the dense items, item i's group argument groups[i] (groups NULL: `group` for all);
   NULL when out of memory. */
static struct job *dense_jobs(const float *const *x, const int64_t *m, const void *const *w,
                              const void *const *scale, float *const *y, int64_t count, int64_t out,
                              int64_t n, int is_int8, int64_t group, const int64_t *groups, int64_t *weights) {
    struct job *jobs = malloc((size_t)count * sizeof *jobs);
    if (!jobs) return NULL;
    *weights = 0;
    for (int64_t i = 0; i < count; i++)
        jobs[i] = dense_job(x[i], m[i], w[i], scale[i], y[i], out, n, is_int8, groups ? groups[i] : group, weights);
    return jobs;
}

/* dense_gemv_items_f32 with, where groups is not NULL, a group argument per item (groups[i]: item i's). */
static int dense_items(const float *const *x, const int64_t *m, const void *const *w, const void *const *scale,
                       float *const *y, int64_t count, int64_t out, int64_t n, int is_int8, int64_t group,
                       const int64_t *groups, int threads, int use_simd) {
    for (int64_t i = 0; i < count; i++)
        if (!int8_group_fits(groups ? groups[i] : group, n)) return -2;
    int64_t weights;
    struct job *jobs = dense_jobs(x, m, w, scale, y, count, out, n, is_int8, group, groups, &weights);
    if (!jobs) return -1;
    const int rc = run_dense(jobs, count, is_int8, out, weights, threads, use_simd);
    free(jobs);
    return rc;
}

/* Many dense products of one weight shape in one call (a MoE layer's chosen experts, a layer's
   projections of one input): item i computes y[i] [m[i], out] = x[i] [m[i], n] @ W_i^T, W_i int8
   (codes w[i] and scales scale[i], int8.py's layout: row scales for group 0, else float16 per group)
   or bf16 bits (is_int8 = 0), each exactly as int8_gemv_f32 / bf16_gemv_f32 computes it alone.
   Returns 0, -1 when out of memory, -2 for a group that does not fit. */
int dense_gemv_items_f32(const float *const *x, const int64_t *m, const void *const *w, const void *const *scale,
                         float *const *y, int64_t count, int64_t out, int64_t n, int is_int8, int64_t group,
                         int threads, int use_simd) {
    if (!int8_group_fits(group, n)) return -2;
    return dense_items(x, m, w, scale, y, count, out, n, is_int8, group, NULL, threads, use_simd);
}

#ifdef KERNELS_X86
/* The dot product of x [n] and row elements at..at+n-1 of w (float32 or bf16 bits) over whole 16-wide
   steps in 16 lanes, then summed; *done: the elements taken. */
static AVX512 float dot_avx512(const float *x, const void *w, int bf16, int64_t at, int64_t n, int64_t *done) {
    __m512 acc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16_avx512(w, bf16, at + k), acc);
    }
    *done = k;
    return _mm512_reduce_add_ps(acc);
}
#endif

/* sum_k x[k] * w[at + k] for k < n, w float32 or bf16 bits: in 16 lanes then in order where avx512 (the
   caller's have_avx512(), asked once), else in order. */
static float dot_f32(const float *x, const void *w, int bf16, int64_t at, int64_t n, int avx512) {
    float acc = 0.0f;
    int64_t k = 0;
#ifdef KERNELS_X86
    if (avx512) acc = dot_avx512(x, w, bf16, at, n, &k);
#endif
    (void)avx512;
    for (; k < n; k++) acc += x[k] * (bf16 ? bf16_to_float(((const uint16_t *)w)[at + k]) : ((const float *)w)[at + k]);
    return acc;
}

/* ------------------------------------------------------------------ RMSNorm of decode-sized rows */

/* y[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, in float32, for rows x [rows, n]; w float32 or bf16
   bits (w_bf16), or NULL for none. The model's torch RMSNorm is ~6 small ops (~50 us a call in a decode
   token, as long as a small product); this is one pass to sum the squares and one to scale. The sum
   runs in 16 lanes (AVX-512) or in order (portable): results differ from torch's by float32 rounding. */
int rms_norm_f32(const float *x, int64_t rows, int64_t n, const void *w, int w_bf16, float eps, float *y,
                 int use_simd) {
    const int avx512 = use_simd && have_avx512();
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * n;
        float *yi = y + i * n;
        const float inv = 1.0f / sqrtf(dot_f32(xi, xi, 0, 0, n, avx512) / (float)n + eps);
        if (!w)
            for (int64_t k = 0; k < n; k++) yi[k] = xi[k] * inv;
        else if (w_bf16)
            for (int64_t k = 0; k < n; k++) yi[k] = xi[k] * inv * bf16_to_float(((const uint16_t *)w)[k]);
        else
            for (int64_t k = 0; k < n; k++) yi[k] = xi[k] * inv * ((const float *)w)[k];
    }
    return 0;
}

/* ------------------------------------------------------------------ a MoE router */

/* The sigmoid router of decode-sized rows x [T, H] (model/moe.py route without expert groups):
     logits = x @ gate^T (gate [E, H] float32 or bf16 bits), scores = sigmoid(logits),
     choice = scores + bias (bias [E] float32), ids[t] = the k largest choices in descending order (the
     lower expert first among equal ones), w[t] = their scores, divided by their sum + 1e-20 when
     renormalize, times scale.
   One call in place of eight torch ops (~150 us a MoE layer of a decode token). The logits sum in 16
   lanes (AVX-512) or in order and the exp is the C library's: scores differ from torch's by float32
   rounding, so a choice between two experts within that rounding may go the other way (a NaN choice
   is never preferred; torch's topk prefers it). Returns 0, -1 when out of memory, -3 for k outside
   1..E. */
int route_sigmoid_f32(const float *x, int64_t T, int64_t H, const void *gate, int gate_bf16, const float *bias,
                      int64_t E, int64_t k, int renormalize, float scale, int64_t *ids, float *w, int use_simd) {
    if (k < 1 || k > E) return -3;
    float *score = malloc((size_t)(2 * E) * sizeof *score);
    if (!score) return -1;
    float *choice = score + E;
    const int avx512 = use_simd && have_avx512();
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * H;
        for (int64_t e = 0; e < E; e++) {
            score[e] = 1.0f / (1.0f + expf(-dot_f32(xt, gate, gate_bf16, e * H, H, avx512)));
            choice[e] = score[e] + bias[e];
        }
        float sum = 0.0f;
        for (int64_t s = 0; s < k; s++) {  /* k is small (8 of 64): k passes */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t q = 0; q < s; q++) taken |= ids[t * k + q] == e;
                const int nan_best = best >= 0 && choice[best] != choice[best];
                if (!taken && (best < 0 || choice[e] > choice[best] || (nan_best && choice[e] == choice[e]))) best = e;
            }
            ids[t * k + s] = best;
            w[t * k + s] = score[best];
            sum += score[best];
        }
        for (int64_t s = 0; s < k; s++) {
            if (renormalize) w[t * k + s] = w[t * k + s] / (sum + 1e-20f);
            w[t * k + s] *= scale;
        }
    }
    free(score);
    return 0;
}

/* ------------------------------------------------------------------ a MoE layer's experts */

/* act[k] = silu(g[k]) * u[k] = g / (1 + exp(-g)) * u, in float32. The AVX-512 exp: n = round(x log2 e),
   r = x - n ln 2 (in two parts), e^r by Cephes' expf polynomial (~1 ulp), times 2^n by vscalefps (which
   rounds under- and overflow as the hardware does); x is first held to [-104, 89], where exp is 0 or
   inf in float32 anyway (a NaN gate stays NaN through the division). */
static void silu_glu_portable(const float *g, const float *u, float *act, int64_t count) {
    for (int64_t k = 0; k < count; k++) act[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
}

#ifdef KERNELS_X86
static inline __attribute__((always_inline)) AVX512 __m512 exp_avx512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
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
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static AVX512 void silu_glu_avx512(const float *g, const float *u, float *act, int64_t count) {
    int64_t k = 0;
    for (; k + 16 <= count; k += 16) {
        const __m512 gv = _mm512_loadu_ps(g + k);
        const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_storeu_ps(act + k, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                                _mm512_loadu_ps(u + k)));
    }
    silu_glu_portable(g + k, u + k, act + k, count - k);
}
#endif

static void (*silu_glu_fn(int use_simd))(const float *, const float *, float *, int64_t) {
#ifdef KERNELS_X86
    if (use_simd && have_avx512()) return silu_glu_avx512;
#endif
    (void)use_simd;
    return silu_glu_portable;
}

/* act [count] = silu(g) * u as moe_silu_f32 computes it (act may be g or u). Returns 0. */
int silu_glu_f32(const float *g, const float *u, float *act, int64_t count, int use_simd) {
    silu_glu_fn(use_simd)(g, u, act, count);
    return 0;
}

/* A MoE layer's chosen experts and its shared expert (shared = 1) over rows x [T, H] in one call, int8
   (codes and scales, int8.py's layout) or bf16 experts (is_int8 = 0) with a SiLU-GLU:
     pair p (P = sum counts, grouped by expert, counts[e] pairs of chosen expert e in order) takes row
     pair_row[p] of x; expert e's gate and up products (w[e], w[items + e]; items = E + shared) run over
     its pairs' rows, act = silu(gate) * up, its down product (w[2 items + e]) over act, and
     y [T, H] = the sum over pairs, in pair order, of pair_weight[p] * down output (y starts at zero);
     the shared expert (item E) runs the same over every row of x into y_shared [T, H].
   Each product is the one dense_gemv_items_f32 computes for those rows (gate and up: [I, H], group
   group_in; down: [H, I], group group_out; the shared expert's groups shared_in and shared_out: it may be
   stored apart from the routed experts, at another group size); the activation differs from torch's by
   its exp's rounding.
   In place of two item calls with the activation, the gathers and the weighted sum between them in torch
   (~250 us of small ops a layer of a decode token). Returns 0, -1 when out of memory, -2 for a group that
   does not fit, -3 for a pair row or count out of range. */
int moe_silu_f32(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, const int64_t *counts,
                 const int64_t *pair_row, const float *pair_weight, const void *const *w, const void *const *scale,
                 int shared, int is_int8, int64_t group_in, int64_t group_out, int64_t shared_in,
                 int64_t shared_out, float *y, float *y_shared, int threads, int use_simd) {
    if (T < 0 || H <= 0 || I <= 0 || E < 0) return -3;
    int64_t P = 0;
    for (int64_t e = 0; e < E; e++) {
        if (counts[e] < 0) return -3;
        P += counts[e];
    }
    for (int64_t p = 0; p < P; p++)
        if (pair_row[p] < 0 || pair_row[p] >= T) return -3;
    const int64_t items = E + (shared ? 1 : 0), R = P + (shared ? T : 0);
    float *xg = malloc((size_t)(R * H + 1) * sizeof *xg), *gu = malloc((size_t)(2 * R * I + 1) * sizeof *gu);
    float *dn = malloc((size_t)(R * H + 1) * sizeof *dn);
    const float **xs = malloc((size_t)(2 * items + 1) * sizeof *xs);
    float **ys = malloc((size_t)(2 * items + 1) * sizeof *ys);
    int64_t *m = malloc((size_t)(2 * items + 1) * sizeof *m), *groups = malloc((size_t)(2 * items + 1) * sizeof *groups);
    int rc = -1;
    if (!xg || !gu || !dn || !xs || !ys || !m || !groups) goto done;
    for (int64_t i = 0, at = 0; i < items; at += m[i], i++) {
        m[i] = m[items + i] = i < E ? counts[i] : T;
        /* An item whose rows are consecutive rows of x (every expert of a one-row pass, the shared expert)
           reads them in place: no copy, and items reading the same rows round them once (int8q_setup). */
        const int64_t first = i < E && m[i] ? pair_row[at] : 0;
        int64_t p = 0;
        while (i < E && p < m[i] && pair_row[at + p] == first + p) p++;
        if (i == E || p == m[i]) {
            xs[i] = x + first * H;
        } else {
            for (p = 0; p < m[i]; p++) memcpy(xg + (at + p) * H, x + pair_row[at + p] * H, (size_t)H * sizeof *xg);
            xs[i] = xg + at * H;
        }
        xs[items + i] = xs[i];
        ys[i] = gu + at * I, ys[items + i] = gu + (R + at) * I;
    }
    for (int64_t i = 0; i < 2 * items; i++) groups[i] = i % items == E ? shared_in : group_in;
    rc = dense_items(xs, m, w, scale, ys, 2 * items, I, H, is_int8, 0, groups, threads, use_simd);
    if (rc) goto done;
    silu_glu_fn(use_simd)(gu, gu + R * I, gu, R * I);  /* act over the gate outputs */
    for (int64_t i = 0, at = 0; i < items; at += m[i], i++) xs[i] = gu + at * I, ys[i] = dn + at * H;
    for (int64_t i = 0; i < items; i++) groups[i] = i == E ? shared_out : group_out;
    rc = dense_items(xs, m, w + 2 * items, scale + 2 * items, ys, items, H, I, is_int8, 0, groups, threads,
                     use_simd);
    if (rc) goto done;
    memset(y, 0, (size_t)(T * H) * sizeof *y);
    for (int64_t p = 0; p < P; p++) {
        float *yr = y + pair_row[p] * H;
        const float *d = dn + p * H, wp = pair_weight[p];
        for (int64_t j = 0; j < H; j++) yr[j] += d[j] * wp;
    }
    if (shared) memcpy(y_shared, dn + P * H, (size_t)(T * H) * sizeof *y_shared);
done:
    free(xg), free(gu), free(dn), free(xs), free(ys), free(m), free(groups);
    return rc;
}

/* A MoE layer's whole feed-forward half for rows p [T, H] of the residual stream, in one call, where every
   expert lies in memory (Kimi Linear: a sigmoid router without expert groups, SiLU-GLU experts):
     x = rms_norm(p) * norm_w                     (rms_norm_f32)
     ids, w = the router's top k of x             (route_sigmoid_f32; ids [T, k] are written out)
     routed, shared = the chosen experts and the shared expert over x (moe_silu_f32, its pairs ordered
                      by expert and within one expert by row and slot: a stable sort of the ids)
     out = p + (routed + shared)                  (shared: zero without one)
   Each step is the function named, called as the layer's separate calls call it, so `out` equals theirs
   bit for bit; what goes is the ~150 us a layer of a decode token that the calls, the ordering of the
   pairs and the additions cost between them. experts_w / experts_scale hold every expert's gate, up and
   down ([E][3]; scales NULL for bf16), shared_w / shared_scale the shared expert's (NULL for none; its
   groups shared_in / shared_out).
   Returns 0, -1 when out of memory, -2 for a group that does not fit, -3 for a bad argument. */
int moe_block_silu_f32(const float *p, int64_t T, int64_t H, const void *norm_w, int norm_bf16, float eps,
                       const void *gate, int gate_bf16, const float *bias, int64_t E, int64_t k, int renormalize,
                       float scale, int64_t I, const void *const *experts_w, const void *const *experts_scale,
                       const void *const *shared_w, const void *const *shared_scale, int is_int8, int64_t group_in,
                       int64_t group_out, int64_t shared_in, int64_t shared_out, int64_t *ids, float *out, int threads,
                       int use_simd) {
    if (T < 0 || H <= 0 || I <= 0 || E < 1 || k < 1 || k > E) return -3;
    if (T == 0) return 0;
    const int64_t P = T * k;
    const int shared = shared_w != NULL;
    float *x = malloc((size_t)(T * H) * sizeof *x), *wts = malloc((size_t)P * sizeof *wts);
    float *pair_w = malloc((size_t)P * sizeof *pair_w), *y = malloc((size_t)(2 * T * H) * sizeof *y);
    int64_t *at = calloc((size_t)(E + 1), sizeof *at), *counts = malloc((size_t)E * sizeof *counts);
    int64_t *which = malloc((size_t)E * sizeof *which), *pair_row = malloc((size_t)P * sizeof *pair_row);
    const void **ws = malloc((size_t)(6 * (E + 1)) * sizeof *ws);
    int rc = -1;
    if (!x || !wts || !pair_w || !y || !at || !counts || !which || !pair_row || !ws) goto done;
    rms_norm_f32(p, T, H, norm_w, norm_bf16, eps, x, use_simd);
    rc = route_sigmoid_f32(x, T, H, gate, gate_bf16, bias, E, k, renormalize, scale, ids, wts, use_simd);
    if (rc) goto done;
    /* the stable sort by expert: count each expert's pairs, then place the pairs in their order */
    for (int64_t q = 0; q < P; q++) at[ids[q] + 1]++;
    int64_t chosen = 0;
    for (int64_t e = 0; e < E; e++) {
        if (at[e + 1]) which[chosen] = e, counts[chosen++] = at[e + 1];
        at[e + 1] += at[e];
    }
    for (int64_t q = 0; q < P; q++) {
        const int64_t to = at[ids[q]]++;
        pair_row[to] = q / k, pair_w[to] = wts[q];
    }
    /* moe_silu_f32 reads its items' gates, then ups, then downs (weights, then scales), the shared
       expert after the chosen ones */
    const int64_t n = chosen + shared;
    for (int j = 0; j < 3; j++) {
        for (int64_t c = 0; c < chosen; c++)
            ws[j * n + c] = experts_w[3 * which[c] + j], ws[3 * n + j * n + c] = experts_scale[3 * which[c] + j];
        if (shared) ws[j * n + chosen] = shared_w[j], ws[3 * n + j * n + chosen] = shared_scale[j];
    }
    rc = moe_silu_f32(x, T, H, I, chosen, counts, pair_row, pair_w, ws, ws + 3 * n, shared, is_int8, group_in,
                      group_out, shared_in, shared_out, y, y + T * H, threads, use_simd);
    if (rc) goto done;
    for (int64_t i = 0; i < T * H; i++) out[i] = p[i] + (y[i] + (shared ? y[T * H + i] : 0.0f));
done:
    free(x), free(wts), free(pair_w), free(y), free(at), free(counts), free(which), free(pair_row), free(ws);
    return rc;
}

/* A dense SiLU-GLU MLP's feed-forward half for rows p [T, H] of the residual stream, in one call (Kimi
   Linear's leading dense layers):
     x = rms_norm(p) * norm_w                     (rms_norm_f32)
     y = down(silu(gate(x)) * up(x))              (moe_silu_f32 with the MLP as its one shared expert)
     out = p + y
   Each step is the function named, the products those the layer's separate calls make (gate and up in
   one dense items call, down as one item of the same kernel), so `out` equals theirs bit for bit.
   w / scale: the gate, up and down weights and their scales (NULL for bf16). Returns 0, -1 when out of
   memory, -2 for a group that does not fit, -3 for a bad argument. */
int mlp_block_silu_f32(const float *p, int64_t T, int64_t H, const void *norm_w, int norm_bf16, float eps, int64_t I,
                       const void *const *w, const void *const *scale, int is_int8, int64_t group_in,
                       int64_t group_out, float *out, int threads, int use_simd) {
    if (T < 0 || H <= 0 || I <= 0) return -3;
    if (T == 0) return 0;
    float *x = malloc((size_t)(T * H) * sizeof *x), *y = malloc((size_t)(2 * T * H) * sizeof *y);
    int rc = -1;
    if (!x || !y) goto done;
    rms_norm_f32(p, T, H, norm_w, norm_bf16, eps, x, use_simd);
    rc = moe_silu_f32(x, T, H, I, 0, NULL, NULL, NULL, w, scale, 1, is_int8, group_in, group_out, group_in, group_out,
                      y, y + T * H, threads, use_simd);
    if (rc) goto done;
    for (int64_t i = 0; i < T * H; i++) out[i] = p[i] + y[T * H + i];
done:
    free(x), free(y);
    return rc;
}

/* One x [m, n] against `count` dense weights of one kind and width n but each its own out[i] rows (a
   KDA layer's beta and low-rank decay and gate projections): y[i] [m, out[i]] = x @ W_i^T, each exactly
   as int8_gemv_f32 / bf16_gemv_f32 computes it alone, in one call (x rounded once for int8). Returns 0,
   -1 when out of memory, -2 for a group that does not fit. */
int dense_gemv_outs_f32(const float *x, int64_t m, const void *const *w, const void *const *scale, float *const *y,
                        int64_t count, const int64_t *out, int64_t n, int is_int8, int64_t group, int threads,
                        int use_simd) {
    if (!int8_group_fits(group, n)) return -2;
    struct job *jobs = malloc((size_t)(count > 0 ? count : 1) * sizeof *jobs);
    if (!jobs) return -1;
    int64_t weights = 0, most = 0;
    for (int64_t i = 0; i < count; i++) {
        jobs[i] = dense_job(x, m, w[i], scale[i], y[i], out[i], n, is_int8, group, &weights);
        most = out[i] > most ? out[i] : most;
    }
    const int rc = run_dense(jobs, count, is_int8, most, weights, threads, use_simd);
    free(jobs);
    return rc;
}

/* Transposed dense products: y [m, n] = x [m, depth] @ W for W [depth, n] (a weight applied from
   its input side, as attention absorbs a key projection into the query). Columns c0..c1-1.
   int8: y[i, c] = sum_d (x[i, d] * scale[d]) * codes[d, c], grouped int8: sum_d x[i, d] * (codes[d, c] *
   scale[d, c / group]); bf16: sum_d x[i, d] * W[d, c]. */
static void dense_gemv_t_cols_portable(const struct job *jb, int64_t c0, int64_t c1) {
    const int64_t n = jb->n;
    float *y = (float *)jb->y;
    for (int64_t i = 0; i < jb->m; i++) {
        float *yi = y + i * n;
        for (int64_t c = c0; c < c1; c++) yi[c] = 0.0f;
        for (int64_t d = 0; d < jb->depth; d++) {
            const float a = jb->x[i * jb->depth + d] * (jb->row_scale ? jb->row_scale[d] : 1.0f);
            for (int64_t c = c0; c < c1; c++) yi[c] += a * dense_weight(jb, d, c);
        }
    }
}

#ifdef KERNELS_X86
/* Columns handled together by the AVX2 transposed product: 4 accumulators of 8. */
#define T_COLS 32

/* 32 weights of row d from column c, as floats in four registers (exact conversions). */
static AVX2_FMA inline void dense_load32_avx2(const struct job *jb, int64_t at, __m256 w[4]) {
    if (jb->codes) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(jb->codes + at));
        const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        for (int q = 0; q < 4; q++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(jb->bf16 + at + 8 * q));
            w[q] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
        }
    }
}

static AVX2_FMA void dense_gemv_t_cols_avx2(const struct job *jb, int64_t c0, int64_t c1) {
    const int64_t n = jb->n, body = c0 + (c1 - c0) / T_COLS * T_COLS;
    float *y = (float *)jb->y;
    for (int64_t i = 0; i < jb->m; i++) {
        const float *xi = jb->x + i * jb->depth;
        for (int64_t c = c0; c < body; c += T_COLS) {
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            /* grouped: the 32 columns from a multiple of 32 lie in one group, column group cg of each row */
            const int64_t groups = jb->half_scale ? n / jb->group : 0, cg = jb->half_scale ? c / jb->group : 0;
            for (int64_t d = 0; d < jb->depth; d++) {
                const __m256 a = _mm256_set1_ps(xi[d] * (jb->row_scale ? jb->row_scale[d] : 1.0f));
                __m256 w[4];
                dense_load32_avx2(jb, d * n + c, w);
                if (groups) {
                    const __m256 sv = _mm256_set1_ps(_cvtsh_ss(jb->half_scale[d * groups + cg]));
                    for (int q = 0; q < 4; q++) w[q] = _mm256_mul_ps(w[q], sv);
                }
                for (int q = 0; q < 4; q++) acc[q] = _mm256_fmadd_ps(a, w[q], acc[q]);
            }
            for (int q = 0; q < 4; q++) _mm256_storeu_ps(y + i * n + c + 8 * q, acc[q]);
        }
        if (body < c1) {
            struct job tail = *jb;
            tail.x = xi, tail.y = y + i * n, tail.m = 1;
            dense_gemv_t_cols_portable(&tail, body, c1);
        }
    }
}
#endif

#ifdef KERNELS_X86
/* The AVX2 transposed product's arithmetic in 16 lanes: 32 weights of row d from column c as two
   registers of floats (exact conversions). */
static AVX512 inline void dense_load32_avx512(const struct job *jb, int64_t at, __m512 w[2]) {
    if (jb->codes) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(jb->codes + at));
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
        w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
    } else {
        w[0] = bf16x16_avx512(jb->bf16 + at), w[1] = bf16x16_avx512(jb->bf16 + at + 16);
    }
}

/* NB (1 to 8) blocks of T_COLS columns from column c of row yi: each column's sum is the AVX2 code's
   (x[d] times the row scale, the weight times its group's scale, one FMA per d in order), so the two
   give the same bits. Up to 256 columns a pass over the rows: the AVX2 code's 32 read one 64-byte
   line of each row per pass, and a head of MLA's W_k (128 rows of 512 codes) ran at ~5 GB/s from DRAM. */
static inline __attribute__((always_inline)) AVX512 void
dense_t_blocks_avx512(const struct job *jb, const float *xi, float *yi, int64_t c, const int NB) {
    const int64_t n = jb->n, groups = jb->half_scale ? n / jb->group : 0;
    __m512 acc[16];
    for (int q = 0; q < 2 * NB; q++) acc[q] = _mm512_setzero_ps();
    for (int64_t d = 0; d < jb->depth; d++) {
        const __m512 a = _mm512_set1_ps(xi[d] * (jb->row_scale ? jb->row_scale[d] : 1.0f));
        for (int b = 0; b < NB; b++) {
            __m512 w[2];
            dense_load32_avx512(jb, d * n + c + b * T_COLS, w);
            if (groups) {
                const __m512 sv = _mm512_set1_ps(_cvtsh_ss(jb->half_scale[d * groups + (c + b * T_COLS) / jb->group]));
                w[0] = _mm512_mul_ps(w[0], sv), w[1] = _mm512_mul_ps(w[1], sv);
            }
            acc[2 * b] = _mm512_fmadd_ps(a, w[0], acc[2 * b]);
            acc[2 * b + 1] = _mm512_fmadd_ps(a, w[1], acc[2 * b + 1]);
        }
    }
    for (int q = 0; q < 2 * NB; q++) _mm512_storeu_ps(yi + c + 16 * q, acc[q]);
}

static AVX512 void dense_gemv_t_cols_avx512(const struct job *jb, int64_t c0, int64_t c1) {
    const int64_t n = jb->n, body = c0 + (c1 - c0) / T_COLS * T_COLS;
    float *y = (float *)jb->y;
    for (int64_t i = 0; i < jb->m; i++) {
        const float *xi = jb->x + i * jb->depth;
        float *yi = y + i * n;
        int64_t c = c0;
        for (; c + 8 * T_COLS <= body; c += 8 * T_COLS) dense_t_blocks_avx512(jb, xi, yi, c, 8);
        switch ((body - c) / T_COLS) {
        case 7: dense_t_blocks_avx512(jb, xi, yi, c, 7); break;
        case 6: dense_t_blocks_avx512(jb, xi, yi, c, 6); break;
        case 5: dense_t_blocks_avx512(jb, xi, yi, c, 5); break;
        case 4: dense_t_blocks_avx512(jb, xi, yi, c, 4); break;
        case 3: dense_t_blocks_avx512(jb, xi, yi, c, 3); break;
        case 2: dense_t_blocks_avx512(jb, xi, yi, c, 2); break;
        case 1: dense_t_blocks_avx512(jb, xi, yi, c, 1); break;
        default: break;
        }
        if (body < c1) {
            struct job tail = *jb;
            tail.x = xi, tail.y = yi, tail.m = 1;
            dense_gemv_t_cols_portable(&tail, body, c1);
        }
    }
}
#endif

/* Many transposed dense products of one weight shape in one call (every head of an attention
   layer): item i computes y[i] [m[i], n] = x[i] [m[i], depth] @ W_i, W_i [depth, n] int8 (codes
   and per-row scales, int8.py's layout, rows being W_i's depth) or bf16 bits. Summed in float32;
   the order differs from dequantize-then-matmul, so results agree to float32 rounding. Returns 0,
   or -1 when out of memory. */
int dense_gemv_t_items_f32(const float *const *x, const int64_t *m, const void *const *w, const void *const *scale,
                           float *const *y, int64_t count, int64_t depth, int64_t n, int is_int8, int64_t group,
                           int threads, int use_simd) {
    if (group < 0 || (group && (group % 32 || n % group))) return -2;
    int64_t weights;
    struct job *jobs = dense_jobs(x, m, w, scale, y, count, n, n, is_int8, group, NULL, &weights);
    if (!jobs) return -1;
    for (int64_t i = 0; i < count; i++) jobs[i].depth = depth;
    rows_fn fn = dense_gemv_t_cols_portable;
    int64_t align = 1;
#ifdef KERNELS_X86
    if (use_simd && have_avx512()) fn = dense_gemv_t_cols_avx512, align = T_COLS;
    else if (use_simd && have_avx2_fma()) fn = dense_gemv_t_cols_avx2, align = T_COLS;
#endif
    (void)use_simd;
    const int rc = run_chunked(jobs, count, fn, n, weights / (n > 0 ? n : 1) * depth, align, threads);
    free(jobs);
    return rc;
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_cpu_kernels",
    .m_doc = "Stored-weight CPU kernels; loaded through ctypes by cpu_native.py.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&module); }

/* ------------------------------------------------------------------ KDA recurrence */

/* One step of a KDA layer for one token of one sequence, one head (kda.py: causal_conv, the q/k normalization,
   decay and beta, kda_recurrent, the output norm and gate), per head h, in float32:
     q, k, v   = silu(causal conv of the pre-conv inputs xin with the stored tails), the tails
                 shifted in place;  q = q / |q| * d^-1/2,  k = k / |k|  (|x| = sqrt(sum x^2 + 1e-6))
     g         = -exp(A_log[h]) * softplus(r + dt_bias)   or, bounded: lb * sigmoid(exp(A_log[h]) * (r + dt_bias))
     beta      = sigmoid(b[h])
     S        <- diag(exp(g)) S;   u = beta (v - S^T k);   S <- S + k u^T   (in place)
     o         = rms_norm(S^T q) * o_norm * sigmoid(gate)
   Torch runs this as ~30 small ops per layer, four of them passes over the whole S (2 MB per layer
   on kl_medium); here each head's S (64 KB) is read and written twice while it sits in cache, and
   the heads of every sequence of the pass are shared between the threads. */
#define KDA_MAX_D 256

struct kda_step {
    const float *xin;           /* [T, 3, D] the pre-conv q, k, v inputs of every row */
    const int64_t *offsets;     /* sequence i's rows: offsets[i] .. offsets[i + 1] - 1, in order */
    float *const *conv;         /* B pointers to [3, K-1, D]: each sequence's last K-1 inputs (updated) */
    const void *conv_w[3];      /* [D, K] each */
    const float *r, *b, *gate;  /* [T, D] decay inputs (before dt_bias), [T, nh] beta logits, [T, D] gates */
    const void *dt_bias, *a_log, *o_norm;  /* [D], [nh], [d] */
    int conv_bf16, dt_bf16, a_bf16, norm_bf16;  /* 1: that tensor holds bf16 bits, 0: float32 */
    int bounded;
    float lower_bound, eps;
    float *const *S;            /* B pointers to [nh, d, d] (updated) */
    float *o;                   /* [T, nh, d] */
    int64_t B, nh, d, K;
    int64_t next;               /* the next (sequence, head) pair to claim (atomic) */
};

static inline float load_f(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

/* The state update and read-out of one head: the two passes over S. */
static inline __attribute__((always_inline)) void
kda_head_passes(float *S, const float *q, const float *k, const float *v, const float *decay, float beta,
                float *o, int64_t d) {
    float kv[KDA_MAX_D], u[KDA_MAX_D];
    for (int64_t j = 0; j < d; j++) kv[j] = 0.0f, o[j] = 0.0f;
    for (int64_t i = 0; i < d; i++) {
        float *row = S + i * d;
        const float e = decay[i], ki = k[i];
        for (int64_t j = 0; j < d; j++) {
            row[j] *= e;
            kv[j] += ki * row[j];
        }
    }
    for (int64_t j = 0; j < d; j++) u[j] = beta * (v[j] - kv[j]);
    for (int64_t i = 0; i < d; i++) {
        float *row = S + i * d;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < d; j++) {
            row[j] += ki * u[j];
            o[j] += qi * row[j];
        }
    }
}

static void kda_head_portable(float *S, const float *q, const float *k, const float *v, const float *decay,
                              float beta, float *o, int64_t d) {
    kda_head_passes(S, q, k, v, decay, beta, o, d);
}

#ifdef KERNELS_X86
static AVX2 void kda_head_avx2(float *S, const float *q, const float *k, const float *v, const float *decay,
                               float beta, float *o, int64_t d) {
    kda_head_passes(S, q, k, v, decay, beta, o, d);  /* the same loops, compiled 8 lanes wide */
}

/* The same loops again, 16 lanes wide. Each element's operations and their order are the loops' own
   (no contraction into FMAs under -std=c11), so every width gives the same bits. */
static AVX512 void kda_head_avx512(float *S, const float *q, const float *k, const float *v, const float *decay,
                                   float beta, float *o, int64_t d) {
    kda_head_passes(S, q, k, v, decay, beta, o, d);
}
#endif

typedef void (*kda_head_fn)(float *, const float *, const float *, const float *, const float *, float, float *,
                            int64_t);

static kda_head_fn kda_head_impl(void) {
#ifdef KERNELS_X86
    if (have_avx512()) return kda_head_avx512;
    if (have_avx2()) return kda_head_avx2;
#endif
    return kda_head_portable;
}

/* The per-channel functions of a step (silu of the conv outputs, the decay, the output gate), 16
   channels at a time with AVX-512 where a head's width is a multiple of 16, else one at a time. The
   vector forms evaluate the same formulas with exp_avx512 and log_avx512 (Cephes' polynomials, ~1 ulp)
   in place of libm's expf and log1pf: those scalar calls were ~60 % of a kl_medium step's time. */
struct kda_channels {
    void (*conv)(const float *x, float *tail, const void *cw, int bf16, int64_t D, int64_t K, int64_t base, int64_t d,
                 float *out);
    void (*silu)(float *x, int64_t n);
    void (*decay)(const float *r, const void *dt_bias, int dt_bf16, float a, int bounded, float lower_bound,
                  float *decay, int64_t n);
    void (*gate)(float *o, float inv, const void *norm, int norm_bf16, const float *gate, int64_t n);
};

/* The causal conv of one head's channels base..base+d-1 of one input (q, k or v): out[j] = the sum, in
   double, of the last K-1 inputs (tail [K-1, D]) and x, each times its tap (cw [D, K], float32 or bf16),
   tap by tap; then the tail moves on by x. Written channel-inner so that the channels run in vector lanes:
   each channel's sum keeps its order, and double products of floats are exact, so every width gives the
   bits of the scalar loop it replaced (~60 % of a kl_medium step's time outside the state passes). */
static inline __attribute__((always_inline)) void
kda_conv_channels(const float *x, float *tail, const void *cw, int bf16, int64_t D, int64_t K, int64_t base,
                  int64_t d, float *out) {
    double acc[KDA_MAX_D];
    for (int64_t j = 0; j < d; j++) acc[j] = 0.0;
    for (int64_t t = 0; t < K; t++) {
        const float *in = t < K - 1 ? tail + t * D + base : x + base;
        if (bf16) {
            const uint16_t *w = (const uint16_t *)cw + base * K + t;
            for (int64_t j = 0; j < d; j++) acc[j] += (double)in[j] * (double)bf16_to_float(w[j * K]);
        } else {
            const float *w = (const float *)cw + base * K + t;
            for (int64_t j = 0; j < d; j++) acc[j] += (double)in[j] * (double)w[j * K];
        }
    }
    for (int64_t t = 0; t + 1 < K - 1; t++) memcpy(tail + t * D + base, tail + (t + 1) * D + base, (size_t)d * sizeof *tail);
    if (K > 1) memcpy(tail + (K - 2) * D + base, x + base, (size_t)d * sizeof *tail);
    for (int64_t j = 0; j < d; j++) out[j] = (float)acc[j];
}

static void kda_conv_portable(const float *x, float *tail, const void *cw, int bf16, int64_t D, int64_t K,
                              int64_t base, int64_t d, float *out) {
    kda_conv_channels(x, tail, cw, bf16, D, K, base, d, out);
}

static void kda_silu_portable(float *x, int64_t n) {
    for (int64_t j = 0; j < n; j++) x[j] = x[j] * sigmoid_f(x[j]);
}

static void kda_decay_portable(const float *r_in, const void *dt_bias, int dt_bf16, float a, int bounded,
                               float lower_bound, float *decay, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        const float r = r_in[j] + load_f(dt_bias, dt_bf16, j);
        float g;
        if (bounded) g = lower_bound * sigmoid_f(a * r);
        else g = -a * (r > 20.0f ? r : log1pf(expf(r)));  /* softplus, torch's threshold */
        decay[j] = expf(g);
    }
}

static void kda_gate_portable(float *o, float inv, const void *norm, int norm_bf16, const float *gate, int64_t n) {
    for (int64_t j = 0; j < n; j++) o[j] = o[j] * inv * load_f(norm, norm_bf16, j) * sigmoid_f(gate[j]);
}

#ifdef KERNELS_X86
/* log(u) for u >= 1 (Cephes' logf: u = m 2^e with m in [sqrt(1/2), sqrt(2)), log(m) by its polynomial). */
static inline __attribute__((always_inline)) AVX512 __m512 log_avx512(__m512 u) {
    __m512 m = _mm512_getmant_ps(u, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);  /* [1, 2) */
    __m512 e = _mm512_getexp_ps(u);
    const __mmask16 high = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356237f), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, high, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_ps(e, high, e, _mm512_set1_ps(1.0f));
    const __m512 x = _mm512_sub_ps(m, _mm512_set1_ps(1.0f)), z = _mm512_mul_ps(x, x);
    __m512 y = _mm512_set1_ps(7.0376836292e-2f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(-1.1514610310e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.1676998740e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(-1.2420140846e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.4249322787e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(-1.6668057665e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(2.0000714765e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(-2.4999993993e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(3.3333331174e-1f));
    y = _mm512_mul_ps(_mm512_mul_ps(y, x), z);
    y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
    y = _mm512_fnmadd_ps(z, _mm512_set1_ps(0.5f), y);
    return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(x, y));
}

static inline __attribute__((always_inline)) AVX512 __m512 sigmoid_avx512(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

static AVX512 void kda_conv_avx512(const float *x, float *tail, const void *cw, int bf16, int64_t D, int64_t K,
                                   int64_t base, int64_t d, float *out) {
    kda_conv_channels(x, tail, cw, bf16, D, K, base, d, out);  /* the same loops, compiled 8 doubles wide */
}

static AVX512 void kda_silu_avx512(float *x, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) {
        const __m512 v = _mm512_loadu_ps(x + j);
        _mm512_storeu_ps(x + j, _mm512_mul_ps(v, sigmoid_avx512(v)));
    }
}

static AVX512 void kda_decay_avx512(const float *r_in, const void *dt_bias, int dt_bf16, float a, int bounded,
                                    float lower_bound, float *decay, int64_t n) {
    const __m512 av = _mm512_set1_ps(a);
    for (int64_t j = 0; j < n; j += 16) {
        const __m512 r = _mm512_add_ps(_mm512_loadu_ps(r_in + j), load16_avx512(dt_bias, dt_bf16, j));
        __m512 g;
        if (bounded) {
            g = _mm512_mul_ps(_mm512_set1_ps(lower_bound), sigmoid_avx512(_mm512_mul_ps(av, r)));
        } else {  /* softplus with torch's threshold; log1p(y) = log(1 + y) * y / ((1 + y) - 1), exact where 1 + y rounds */
            const __m512 y = exp_avx512(r), u = _mm512_add_ps(_mm512_set1_ps(1.0f), y);
            const __m512 du = _mm512_sub_ps(u, _mm512_set1_ps(1.0f));
            const __mmask16 rounded = _mm512_cmp_ps_mask(du, _mm512_setzero_ps(), _CMP_EQ_OQ);
            __m512 sp = _mm512_mask_blend_ps(rounded, _mm512_div_ps(_mm512_mul_ps(log_avx512(u), y), du), y);
            sp = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, _mm512_set1_ps(20.0f), _CMP_GT_OQ), sp, r);
            g = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), av), sp);
        }
        _mm512_storeu_ps(decay + j, exp_avx512(g));
    }
}

static AVX512 void kda_gate_avx512(float *o, float inv, const void *norm, int norm_bf16, const float *gate, int64_t n) {
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t j = 0; j < n; j += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(o + j), iv), load16_avx512(norm, norm_bf16, j));
        _mm512_storeu_ps(o + j, _mm512_mul_ps(v, sigmoid_avx512(_mm512_loadu_ps(gate + j))));
    }
}
#endif

static struct kda_channels kda_channels_impl(int64_t d) {
#ifdef KERNELS_X86
    if (have_avx512() && d % 16 == 0)
        return (struct kda_channels){kda_conv_avx512, kda_silu_avx512, kda_decay_avx512, kda_gate_avx512};
#endif
    (void)d;
    return (struct kda_channels){kda_conv_portable, kda_silu_portable, kda_decay_portable, kda_gate_portable};
}

static void kda_step_row(const struct kda_step *st, int64_t seq, int64_t row, int64_t h, kda_head_fn head,
                         const struct kda_channels *ch) {
    const int64_t d = st->d, D = st->nh * d, K = st->K, base = h * d;
    const float *xin = st->xin + row * 3 * D, *r_in = st->r + row * D, *gate = st->gate + row * D;
    float *conv = st->conv[seq];
    float qkv[3][KDA_MAX_D], decay[KDA_MAX_D];
    for (int w = 0; w < 3; w++) {
        ch->conv(xin + w * D, conv + (int64_t)w * (K - 1) * D, st->conv_w[w], st->conv_bf16, D, K, base, d, qkv[w]);
        ch->silu(qkv[w], d);
    }
    float *q = qkv[0], *k = qkv[1];
    double sq = 0.0, sk = 0.0;
    for (int64_t j = 0; j < d; j++) sq += (double)q[j] * q[j], sk += (double)k[j] * k[j];
    const float nq = (float)sqrt(sq + 1e-6), nk = (float)sqrt(sk + 1e-6), scale = 1.0f / sqrtf((float)d);
    for (int64_t j = 0; j < d; j++) q[j] = q[j] / nq * scale, k[j] = k[j] / nk;
    const float a = expf(load_f(st->a_log, st->a_bf16, h));
    const void *dt_bias = st->dt_bf16 ? (const void *)((const uint16_t *)st->dt_bias + base)
                                      : (const void *)((const float *)st->dt_bias + base);
    ch->decay(r_in + base, dt_bias, st->dt_bf16, a, st->bounded, st->lower_bound, decay, d);
    float *o = st->o + row * D + base;
    head(st->S[seq] + h * d * d, q, k, qkv[2], decay, sigmoid_f(st->b[row * st->nh + h]), o, d);
    double ss = 0.0;
    for (int64_t j = 0; j < d; j++) ss += (double)o[j] * o[j];
    const float inv = (float)(1.0 / sqrt(ss / (double)d + st->eps));
    ch->gate(o, inv, st->o_norm, st->norm_bf16, gate + base, d);
}

static void *run_kda_heads(void *arg) {
    struct kda_step *st = (struct kda_step *)arg;
    const kda_head_fn head = kda_head_impl();
    const struct kda_channels ch = kda_channels_impl(st->d);
    for (;;) {
        const int64_t i = __atomic_fetch_add(&st->next, 1, __ATOMIC_RELAXED);
        if (i >= st->B * st->nh) break;
        const int64_t seq = i / st->nh, h = i % st->nh;
        /* one head of one sequence, its rows in order: that head's S stays in cache between them */
        for (int64_t row = st->offsets[seq]; row < st->offsets[seq + 1]; row++) kda_step_row(st, seq, row, h, head, &ch);
    }
    return NULL;
}

/* The step above for every row of B sequences of one layer, each sequence's rows in order (decode
   steps, draft checks and prompt pieces alike: one call a layer, not one per sequence or token);
   the (sequence, head) pairs are claimed by up to `threads` threads as they come free (one thread
   when the work is small). Each pair is one thread's work from start to end, so a sequence's result
   depends neither on the split nor on the other sequences. Returns 0, or -1 when d exceeds
   KDA_MAX_D or the B + 1 offsets do not start at 0 and grow. */
int kda_steps_f32(int64_t B, const int64_t *offsets, const float *xin, float *const *conv,
                  const void *const *conv_w, int conv_bf16, const float *r, const void *dt_bias, int dt_bf16,
                  const void *a_log, int a_bf16, const float *b, int bounded, float lower_bound, const float *gate,
                  const void *o_norm, int norm_bf16, float eps, float *const *S, float *o, int64_t nh, int64_t d,
                  int64_t K, int threads) {
    if (d > KDA_MAX_D || d < 1 || K < 1 || B < 0 || offsets[0] != 0) return -1;
    for (int64_t i = 0; i < B; i++)
        if (offsets[i + 1] < offsets[i]) return -1;
    const int64_t rows = offsets[B];
    struct kda_step st = {.xin = xin, .offsets = offsets, .conv = conv,
                          .conv_w = {conv_w[0], conv_w[1], conv_w[2]}, .r = r, .b = b,
                          .gate = gate, .dt_bias = dt_bias, .a_log = a_log, .o_norm = o_norm,
                          .conv_bf16 = conv_bf16, .dt_bf16 = dt_bf16, .a_bf16 = a_bf16, .norm_bf16 = norm_bf16,
                          .bounded = bounded, .lower_bound = lower_bound, .eps = eps, .S = S, .o = o,
                          .B = B, .nh = nh, .d = d, .K = K, .next = 0};
    int64_t t = threads;
    if (t > B * nh) t = B * nh;
    if (rows * nh * d * d < MIN_WEIGHTS_PER_THREAD / 4) t = 1;  /* little work: waking a thread costs more */
    run_parallel(run_kda_heads, &st, 0, t < 1 ? 1 : (int)t);
    return 0;
}

/* A KDA layer's attention half for the rows h [T, H] of B sequences in one call (a resident Kimi Linear
   layer on the CPU: low-rank decay and gate):
     x = rms_norm(h) * norm_w                                   (rms_norm_f32)
     q, k, v, beta, f_a, g_a = x @ W_i^T for w1[0..5]           (dense_gemv_outs_f32: one kind, out sizes
                                                                 D, D, D, nh, d, d)
     r, gate = f_a @ w2[0]^T, g_a @ w2[1]^T                     (dense_gemv_items_f32: [D, d] each)
     o = every sequence's recurrence over its rows              (kda_steps_f32, xin = q | k | v a row)
     out = h + o @ wo^T                                         (dense_gemv_outs_f32 with one weight)
   Each step is the function named, called as the layer's separate calls call it, so `out` and the
   states equal theirs bit for bit; what goes is the time between the calls (~300 us a layer of a
   decode token). Returns 0, -1 when out of memory, -2 for a group that does not fit, or what
   kda_steps_f32 returns. */
int kda_block_f32(const float *h, int64_t T, int64_t H, const void *norm_w, int norm_bf16, float eps,
                  const void *const *w1, const void *const *s1, int kind1, int64_t group1,
                  const void *const *w2, const void *const *s2, int kind2, int64_t group2,
                  const void *wo, const void *so, int kindo, int64_t groupo,
                  int64_t B, const int64_t *offsets, float *const *conv, const void *const *conv_w, int conv_bf16,
                  const void *dt_bias, int dt_bf16, const void *a_log, int a_bf16, int bounded, float lower_bound,
                  const void *o_norm, int o_norm_bf16, float *const *S, int64_t nh, int64_t d, int64_t K,
                  float *out, int threads, int use_simd) {
    if (T < 1 || H < 1 || nh < 1 || d < 1 || B < 1 || offsets[B] != T) return -3;
    const int64_t D = nh * d;
    const int64_t sizes[6] = {D, D, D, nh, d, d}, one_out[1] = {H};
    float *x = malloc((size_t)(T * H) * sizeof *x), *first = malloc((size_t)(T * (3 * D + nh + 2 * d)) * sizeof *first);
    float *xin = malloc((size_t)(T * 3 * D) * sizeof *xin), *rg = malloc((size_t)(2 * T * D) * sizeof *rg);
    float *o = malloc((size_t)(T * D) * sizeof *o), *y = malloc((size_t)(T * H) * sizeof *y);
    int rc = -1;
    if (!x || !first || !xin || !rg || !o || !y) goto done;
    rms_norm_f32(h, T, H, norm_w, norm_bf16, eps, x, use_simd);
    float *ys[6];
    for (int64_t i = 0, at = 0; i < 6; at += T * sizes[i], i++) ys[i] = first + at;
    rc = dense_gemv_outs_f32(x, T, w1, s1, ys, 6, sizes, H, kind1, group1, threads, use_simd);
    if (rc) goto done;
    for (int64_t t = 0; t < T; t++)  /* xin [T, 3, D]: a row's q, k and v side by side */
        for (int w = 0; w < 3; w++) memcpy(xin + (t * 3 + w) * D, ys[w] + t * D, (size_t)D * sizeof *xin);
    const float *low[2] = {ys[4], ys[5]};
    float *rg_out[2] = {rg, rg + T * D};
    const int64_t rows[2] = {T, T};
    rc = dense_gemv_items_f32(low, rows, w2, s2, rg_out, 2, D, d, kind2, group2, threads, use_simd);
    if (rc) goto done;
    rc = kda_steps_f32(B, offsets, xin, conv, conv_w, conv_bf16, rg, dt_bias, dt_bf16, a_log, a_bf16, ys[3], bounded,
                       lower_bound, rg + T * D, o_norm, o_norm_bf16, eps, S, o, nh, d, K, threads);
    if (rc) goto done;
    float *yo[1] = {y};
    rc = dense_gemv_outs_f32(o, T, &wo, &so, yo, 1, one_out, D, kindo, groupo, threads, use_simd);
    if (rc) goto done;
    for (int64_t i = 0; i < T * H; i++) out[i] = h[i] + y[i];
done:
    free(x), free(first), free(xin), free(rg), free(o), free(y);
    return rc;
}

/* ------------------------------------------------------------------ MLA decode attention */

/* Latent attention of one new query per sequence (mla.py _attend_latent for a decode step), for
   sequence b and head h:
     s_j      = (q_lat[b,h] . ckv_b[j] + q_rot[b,h] . krot_b[j]) * scale      for j < len[b]
     out[b,h] = sum_j softmax(s)_j ckv_b[j]
   A claim is MLA_HEADS heads of one sequence: they take the cache rows MLA_BLOCK at a time, each
   block read while it sits in cache (a loop per head would read the whole cache once per head),
   and the softmax runs online (a running max and sum per head; the sums so far are rescaled when
   the max grows). Torch ran this as ~8 small ops per sequence and layer. */
#define MLA_BLOCK 16
#define MLA_HEADS 8

struct mla_attend {
    const float *q_lat, *q_rot;        /* [B, nh, r], [B, nh, rope] */
    const float *const *ckv, *const *krot;  /* B pointers to [len[b], r] and [len[b], rope] */
    const int64_t *len;
    float scale;
    float *out;                        /* [B, nh, r] */
    int64_t B, nh, r, rope, groups;    /* groups: claims of MLA_HEADS heads per sequence */
};

/* x . y in 8 independent lanes, added up at the end: vectorizes without reassociating a sum. */
static inline __attribute__((always_inline)) float mla_dot(const float *x, const float *y, int64_t n) {
    float lane[8] = {0};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        for (int i = 0; i < 8; i++) lane[i] += x[k + i] * y[k + i];
    for (; k < n; k++) lane[k & 7] += x[k] * y[k];
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

static inline __attribute__((always_inline)) void
mla_heads(const struct mla_attend *a, int64_t b, int64_t h0, int64_t hn) {
    const int64_t r = a->r, rope = a->rope, L = a->len[b], nh = a->nh;
    const float *ckv = a->ckv[b], *krot = a->krot[b];
    float m[MLA_HEADS], sum[MLA_HEADS], w[MLA_HEADS][MLA_BLOCK];
    for (int64_t i = 0; i < hn; i++) {
        m[i] = -INFINITY, sum[i] = 0.0f;
        float *o = a->out + (b * nh + h0 + i) * r;
        for (int64_t k = 0; k < r; k++) o[k] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < L; j0 += MLA_BLOCK) {
        const int64_t jn = L - j0 < MLA_BLOCK ? L - j0 : MLA_BLOCK;
        for (int64_t i = 0; i < hn; i++) {
            const float *q = a->q_lat + (b * nh + h0 + i) * r, *qr = a->q_rot + (b * nh + h0 + i) * rope;
            float top = m[i];
            for (int64_t jj = 0; jj < jn; jj++) {
                const int64_t j = j0 + jj;
                w[i][jj] = (mla_dot(q, ckv + j * r, r) + mla_dot(qr, krot + j * rope, rope)) * a->scale;
                if (w[i][jj] > top) top = w[i][jj];
            }
            float *o = a->out + (b * nh + h0 + i) * r;
            if (top > m[i]) {  /* a larger max: what was summed so far shrinks by exp(old - new) */
                const float c = m[i] == -INFINITY ? 0.0f : expf(m[i] - top);
                sum[i] *= c;
                for (int64_t k = 0; k < r; k++) o[k] *= c;
                m[i] = top;
            }
            for (int64_t jj = 0; jj < jn; jj++) {
                const float e = expf(w[i][jj] - m[i]);
                sum[i] += e;
                const float *row = ckv + (j0 + jj) * r;
                for (int64_t k = 0; k < r; k++) o[k] += e * row[k];
            }
        }
    }
    for (int64_t i = 0; i < hn; i++) {
        float *o = a->out + (b * nh + h0 + i) * r;
        const float inv = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
        for (int64_t k = 0; k < r; k++) o[k] *= inv;
    }
}

static void mla_heads_portable(const struct mla_attend *a, int64_t b, int64_t h0, int64_t hn) {
    mla_heads(a, b, h0, hn);
}

#ifdef KERNELS_X86
static AVX2 void mla_heads_avx2(const struct mla_attend *a, int64_t b, int64_t h0, int64_t hn) {
    mla_heads(a, b, h0, hn);  /* the same loops, compiled 8 lanes wide */
}
#endif

#ifdef KERNELS_X86
/* The AVX-512 attention where r and rope are multiples of 16, as a small matrix product over blocks of
   MLA_BLOCK cache rows: for up to MLA_HEADS heads at a time, the scores of two rows at once with each row
   loaded once for all of them, the block's softmax weights 16 rows at once (exp_avx512 in place of libm's
   expf, as the KDA step), and the weighted rows summed in registers 16 latent lanes at a time, stored once
   a block (the loops above stream each head's whole output through memory for every row). The same
   formulas in another summation order: the latents follow the loops above within float32 rounding.
   HN: the heads, a constant where it is MLA_HEADS or 4 (K3's and Kimi Linear's, small-k3's). */
static inline __attribute__((always_inline)) AVX512 void
mla_block_avx512(const float *ckv, const float *krot, int64_t r, int64_t rope, int64_t j0, int jn, __m512 scale,
                 const float *const *q, const float *const *qr, float *const *o, float *m, float *sum, const int HN) {
    float w[MLA_HEADS][MLA_BLOCK] __attribute__((aligned(64)));
    for (int jj = 0; jj < jn; jj += 2) {  /* scores, two rows at a time (the second a repeat past the end) */
        const int64_t j = j0 + jj, j2 = jj + 1 < jn ? j + 1 : j;
        __m512 s1[MLA_HEADS], s2[MLA_HEADS];
        for (int i = 0; i < HN; i++) s1[i] = _mm512_setzero_ps(), s2[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < r; k += 16) {
            const __m512 x1 = _mm512_loadu_ps(ckv + j * r + k), x2 = _mm512_loadu_ps(ckv + j2 * r + k);
            for (int i = 0; i < HN; i++) {
                const __m512 qv = _mm512_loadu_ps(q[i] + k);
                s1[i] = _mm512_fmadd_ps(qv, x1, s1[i]), s2[i] = _mm512_fmadd_ps(qv, x2, s2[i]);
            }
        }
        for (int64_t k = 0; k < rope; k += 16) {
            const __m512 x1 = _mm512_loadu_ps(krot + j * rope + k), x2 = _mm512_loadu_ps(krot + j2 * rope + k);
            for (int i = 0; i < HN; i++) {
                const __m512 qv = _mm512_loadu_ps(qr[i] + k);
                s1[i] = _mm512_fmadd_ps(qv, x1, s1[i]), s2[i] = _mm512_fmadd_ps(qv, x2, s2[i]);
            }
        }
        for (int i = 0; i < HN; i++) {
            w[i][jj] = _mm512_reduce_add_ps(s1[i]);
            if (jj + 1 < jn) w[i][jj + 1] = _mm512_reduce_add_ps(s2[i]);
        }
    }
    const __mmask16 valid = (__mmask16)(jn == MLA_BLOCK ? 0xFFFF : (1u << jn) - 1);
    for (int i = 0; i < HN; i++) {  /* the block's weights, its rows in lanes; the running max and sum */
        const __m512 v = _mm512_mul_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, w[i]), scale);
        const float top = _mm512_mask_reduce_max_ps(valid, v);
        if (top > m[i]) {  /* a larger max: what was summed so far shrinks by exp(old - new) */
            const float c = m[i] == -INFINITY ? 0.0f : expf(m[i] - top);
            sum[i] *= c;
            const __m512 cv = _mm512_set1_ps(c);
            for (int64_t k = 0; k < r; k += 16) _mm512_storeu_ps(o[i] + k, _mm512_mul_ps(_mm512_loadu_ps(o[i] + k), cv));
            m[i] = top;
        }
        const __m512 e = _mm512_maskz_mov_ps(valid, exp_avx512(_mm512_sub_ps(v, _mm512_set1_ps(m[i]))));
        _mm512_store_ps(w[i], e);
        sum[i] += _mm512_reduce_add_ps(e);
    }
    for (int64_t k = 0; k < r; k += 16) {  /* the weighted rows, 16 lanes of every head at a time */
        __m512 acc[MLA_HEADS];
        for (int i = 0; i < HN; i++) acc[i] = _mm512_loadu_ps(o[i] + k);
        for (int jj = 0; jj < jn; jj++) {
            const __m512 x = _mm512_loadu_ps(ckv + (j0 + jj) * r + k);
            for (int i = 0; i < HN; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(w[i][jj]), x, acc[i]);
        }
        for (int i = 0; i < HN; i++) _mm512_storeu_ps(o[i] + k, acc[i]);
    }
}

/* Cache rows j_begin..j_end-1 of sequence b for heads h0..h0+hn-1 (any number): each block of rows taken
   by MLA_HEADS heads at a time while it sits in cache, so the rows are read from memory once for all hn.
   o[i * r ..] (zeroed), m[i] (-inf) and sum[i] (0) of head h0 + i are the running softmax state, not
   normalized. */
static AVX512 void mla_rows_avx512(const struct mla_attend *a, int64_t b, int64_t j_begin, int64_t j_end, int64_t h0,
                                   int64_t hn, float *o_base, float *m, float *sum) {
    const int64_t r = a->r, rope = a->rope, nh = a->nh;
    const float *ckv = a->ckv[b], *krot = a->krot[b];
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int64_t j0 = j_begin; j0 < j_end; j0 += MLA_BLOCK) {
        const int jn = j_end - j0 < MLA_BLOCK ? (int)(j_end - j0) : MLA_BLOCK;
        for (int64_t g = 0; g < hn; g += MLA_HEADS) {
            const int gn = hn - g < MLA_HEADS ? (int)(hn - g) : MLA_HEADS;
            const float *q[MLA_HEADS], *qr[MLA_HEADS];
            float *o[MLA_HEADS];
            for (int i = 0; i < gn; i++) {
                const int64_t h = h0 + g + i;
                q[i] = a->q_lat + (b * nh + h) * r, qr[i] = a->q_rot + (b * nh + h) * rope, o[i] = o_base + (g + i) * r;
            }
            if (gn == MLA_HEADS) mla_block_avx512(ckv, krot, r, rope, j0, jn, scale, q, qr, o, m + g, sum + g, MLA_HEADS);
            else if (gn == 4) mla_block_avx512(ckv, krot, r, rope, j0, jn, scale, q, qr, o, m + g, sum + g, 4);
            else mla_block_avx512(ckv, krot, r, rope, j0, jn, scale, q, qr, o, m + g, sum + g, gn);
        }
    }
}
#endif

/* Whether the attention of latents of width r and rope keys of width rope runs the AVX-512 kernel (both
   multiples of 16, on a CPU with AVX-512 within the simd limit); else the loops above. Python asks it to
   know how long a cache the native attention should take (cpu_native.mla_attend_blocked). */
int mla_attend_blocked(int64_t r, int64_t rope) {
#ifdef KERNELS_X86
    return have_avx512() && r % 16 == 0 && rope % 16 == 0;
#else
    (void)r, (void)rope;
    return 0;
#endif
}

/* A claim of the attention: heads h0..h0+hn-1 of sequence b over cache rows j0..j1-1. part < 0: the whole
   cache, normalized into out; else a chunk of a long cache, its running state kept in the call's partials
   (entry `part`) for the merge. */
struct mla_claim {
    int64_t b, j0, j1, h0, hn, part;
};

/* A long cache (the AVX-512 kernel, more than MLA_LONG rows: past what the last-level cache keeps between
   the claims of MLA_HEADS heads) is claimed by chunks of MLA_CHUNK rows and MLA_WIDE heads, so that each
   chunk is read from memory once for MLA_WIDE heads rather than once per MLA_HEADS; the chunks' softmax
   states are then merged in row order. Both sizes are fixed, so a sequence's result does not depend on the
   threads. (Measured, one sequence, 2 threads, medians of 9 calls, 7 rounds alternating with claims of 8
   heads over all rows: 32 heads of 512 over 8,192 rows 3.8-5.0 ms against 4.0-7.2 (medians 4.6 and 5.0),
   64 heads 8.0-9.9 against 8.7-18.6 (8.5 and 11.2); over 2,048 rows the chunks cost more than they save:
   0.92-1.25 against 0.88-1.13 ms.) */
#define MLA_LONG 4096
#define MLA_CHUNK 256
#define MLA_WIDE 32

/* The chunks a cache of L rows is claimed in, 0 where it is claimed by heads over all its rows. */
static int64_t mla_chunks(int blocked, int64_t L) {
    return blocked && L > MLA_LONG ? (L + MLA_CHUNK - 1) / MLA_CHUNK : 0;
}

struct mla_work {
    const struct mla_attend *a;
    int blocked;                      /* the AVX-512 kernel (r and rope multiples of 16), else the loops */
    const struct mla_claim *claims;
    int64_t count;
    float *part_o, *part_m, *part_s;  /* [parts, nh, r], [parts, nh], [parts, nh] */
    int64_t next;                     /* the next claim (atomic) */
};

static void *run_mla_attend(void *arg) {
    struct mla_work *wk = (struct mla_work *)arg;
    const struct mla_attend *a = wk->a;
    void (*heads)(const struct mla_attend *, int64_t, int64_t, int64_t) = mla_heads_portable;
#ifdef KERNELS_X86
    if (have_avx2()) heads = mla_heads_avx2;
#endif
    for (;;) {
        const int64_t c = __atomic_fetch_add(&wk->next, 1, __ATOMIC_RELAXED);
        if (c >= wk->count) break;
        const struct mla_claim *cl = &wk->claims[c];
        if (!wk->blocked) {
            heads(a, cl->b, cl->h0, cl->hn);
            continue;
        }
#ifdef KERNELS_X86
        float m[MLA_WIDE], sum[MLA_WIDE], *o;
        float *pm = m, *ps = sum;
        if (cl->part < 0) {
            o = a->out + (cl->b * a->nh + cl->h0) * a->r;
        } else {
            const int64_t at = cl->part * a->nh + cl->h0;
            o = wk->part_o + at * a->r, pm = wk->part_m + at, ps = wk->part_s + at;
        }
        memset(o, 0, (size_t)(cl->hn * a->r) * sizeof *o);
        for (int64_t i = 0; i < cl->hn; i++) pm[i] = -INFINITY, ps[i] = 0.0f;
        mla_rows_avx512(a, cl->b, cl->j0, cl->j1, cl->h0, cl->hn, o, pm, ps);
        if (cl->part < 0)
            for (int64_t i = 0; i < cl->hn; i++) {
                const float inv = ps[i] > 0.0f ? 1.0f / ps[i] : 0.0f;
                for (int64_t k = 0; k < a->r; k++) o[i * a->r + k] *= inv;
            }
#endif
    }
    return NULL;
}

/* The attention above for B decoding sequences of one layer in one call; claims (one sequence and up to
   MLA_HEADS heads; with the AVX-512 kernel, a chunk of a long cache and up to MLA_WIDE heads) go to up to
   `threads` threads as they come free, each one thread's work from start to end, so a sequence's result
   depends neither on the split nor on the other sequences. Returns 0, -1 for a negative length or when
   out of memory. */
int mla_decode_attend_f32(int64_t B, const float *q_lat, const float *q_rot, const float *const *ckv,
                          const float *const *krot, const int64_t *len, float scale, float *out, int64_t nh,
                          int64_t r, int64_t rope, int threads) {
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) {
        if (len[b] < 0) return -1;
        work += len[b];
    }
    const int blocked = mla_attend_blocked(r, rope);
    const struct mla_attend a = {.q_lat = q_lat, .q_rot = q_rot, .ckv = ckv, .krot = krot, .len = len, .scale = scale,
                                 .out = out, .B = B, .nh = nh, .r = r, .rope = rope,
                                 .groups = (nh + MLA_HEADS - 1) / MLA_HEADS};
    int64_t count = 0, parts = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t chunks = mla_chunks(blocked, len[b]);
        if (chunks) count += chunks * ((nh + MLA_WIDE - 1) / MLA_WIDE), parts += chunks;
        else count += a.groups;
    }
    struct mla_claim *claims = malloc((size_t)(count + 1) * sizeof *claims);
    float *part_o = parts ? malloc((size_t)(parts * nh * r) * sizeof *part_o) : NULL;
    float *part_m = parts ? malloc((size_t)(parts * nh) * sizeof *part_m) : NULL;
    float *part_s = parts ? malloc((size_t)(parts * nh) * sizeof *part_s) : NULL;
    int rc = -1;
    if (!claims || (parts && (!part_o || !part_m || !part_s))) goto done;
    int64_t n = 0, p = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t chunks = mla_chunks(blocked, len[b]);
        if (chunks) {
            for (int64_t c = 0; c < chunks; c++, p++)
                for (int64_t h0 = 0; h0 < nh; h0 += MLA_WIDE) {
                    const int64_t j1 = (c + 1) * MLA_CHUNK < len[b] ? (c + 1) * MLA_CHUNK : len[b];
                    claims[n++] = (struct mla_claim){b, c * MLA_CHUNK, j1, h0, nh - h0 < MLA_WIDE ? nh - h0 : MLA_WIDE, p};
                }
        } else {
            for (int64_t h0 = 0; h0 < nh; h0 += MLA_HEADS)
                claims[n++] = (struct mla_claim){b, 0, len[b], h0, nh - h0 < MLA_HEADS ? nh - h0 : MLA_HEADS, -1};
        }
    }
    struct mla_work wk = {&a, blocked, claims, count, part_o, part_m, part_s, 0};
    int64_t t = threads;
    if (t > count) t = count;
    if (work * nh * (r + rope) < MIN_WEIGHTS_PER_THREAD) t = 1;  /* little work: waking a thread costs more */
    run_parallel(run_mla_attend, &wk, 0, t < 1 ? 1 : (int)t);
    /* each long cache's chunks merged in row order: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) s_c */
    p = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t chunks = mla_chunks(blocked, len[b]);
        if (!chunks) continue;
        for (int64_t h = 0; h < nh; h++) {
            float top = -INFINITY;
            for (int64_t c = 0; c < chunks; c++) top = part_m[(p + c) * nh + h] > top ? part_m[(p + c) * nh + h] : top;
            float *o = out + (b * nh + h) * r, total = 0.0f;
            for (int64_t k = 0; k < r; k++) o[k] = 0.0f;
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t at = (p + c) * nh + h;
                const float f = part_m[at] == -INFINITY ? 0.0f : expf(part_m[at] - top);
                total += f * part_s[at];
                for (int64_t k = 0; k < r; k++) o[k] += f * part_o[at * r + k];
            }
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
            for (int64_t k = 0; k < r; k++) o[k] *= inv;
        }
        p += chunks;
    }
    rc = 0;
done:
    free(claims), free(part_o), free(part_m), free(part_s);
    return rc;
}

/* An MLA layer's attention half for B decoding sequences, one row each, in one call (a resident Kimi
   Linear layer on the CPU: a plain query projection, no output gate), caches in float32:
     x = rms_norm(h) * norm_w                                    (rms_norm_f32)
     q, kv = x @ wq^T, x @ wkv^T                                 (dense_gemv_outs_f32, one kind)
     sequence b's cache row len[b] - 1 = rms_norm(kv[:r]) * latent_w, kv[r:]   (rms_norm_f32)
     q_lat[h] = q_nope[h] @ W_k[h]                               (dense_gemv_t_items_f32, every head)
     lat = the latent attention of each sequence over its cache (mla_decode_attend_f32)
     o[:, h] = lat[h] @ W_v[h]^T                                 (dense_gemv_items_f32, every head)
     out = h + o @ wo^T                                          (dense_gemv_outs_f32 with one weight)
   Each step is the function named, called as mla.py's separate calls call it, so `out` and the caches
   equal theirs bit for bit; what goes is the time between the calls and the copies around them. The
   caches must hold len[b] rows already (the new one is written, then attended). Returns 0, -1 when out
   of memory, -2 for a group that does not fit, -3 for sizes that make no sense. */
int mla_block_f32(const float *h, int64_t B, int64_t H, const void *norm_w, int norm_bf16, float eps,
                  const void *const *w1, const void *const *s1, int kind1, int64_t group1,
                  const void *latent_w, int latent_bf16, float latent_eps,
                  const void *const *wk, const void *const *sk, int kindk, int64_t groupk,
                  const void *const *wv, const void *const *sv, int kindv, int64_t groupv,
                  const void *wo, const void *so, int kindo, int64_t groupo,
                  float *const *ckv, float *const *krot, const int64_t *len, float scale,
                  int64_t nh, int64_t nope, int64_t rope, int64_t r, int64_t dv, float *out, int threads,
                  int use_simd) {
    if (B < 1 || H < 1 || nh < 1 || nope < 1 || rope < 1 || r < 1 || dv < 1) return -3;
    for (int64_t b = 0; b < B; b++)
        if (len[b] < 1) return -3;
    const int64_t qw = nh * (nope + rope), kvw = r + rope, sizes[2] = {qw, kvw}, one_out[1] = {H};
    float *x = malloc((size_t)(B * H) * sizeof *x), *q = malloc((size_t)(B * qw) * sizeof *q);
    float *kv = malloc((size_t)(B * kvw) * sizeof *kv), *lnorm = malloc((size_t)(B * r) * sizeof *lnorm);
    float *qn = malloc((size_t)(nh * B * nope) * sizeof *qn), *ql = malloc((size_t)(nh * B * r) * sizeof *ql);
    float *qlb = malloc((size_t)(B * nh * r) * sizeof *qlb), *qr = malloc((size_t)(B * nh * rope) * sizeof *qr);
    float *lat = malloc((size_t)(B * nh * r) * sizeof *lat), *lath = malloc((size_t)(nh * B * r) * sizeof *lath);
    float *vals = malloc((size_t)(nh * B * dv) * sizeof *vals), *o = malloc((size_t)(B * nh * dv) * sizeof *o);
    float *y = malloc((size_t)(B * H) * sizeof *y);
    const float **xs = malloc((size_t)nh * sizeof *xs);
    float **ys = malloc((size_t)nh * sizeof *ys);
    int64_t *rows = malloc((size_t)nh * sizeof *rows);
    int rc = -1;
    if (!x || !q || !kv || !lnorm || !qn || !ql || !qlb || !qr || !lat || !lath || !vals || !o || !y || !xs || !ys || !rows)
        goto done;
    rms_norm_f32(h, B, H, norm_w, norm_bf16, eps, x, use_simd);
    float *qkv[2] = {q, kv};
    rc = dense_gemv_outs_f32(x, B, w1, s1, qkv, 2, sizes, H, kind1, group1, threads, use_simd);
    if (rc) goto done;
    for (int64_t b = 0; b < B; b++) memcpy(lnorm + b * r, kv + b * kvw, (size_t)r * sizeof *lnorm);
    rms_norm_f32(lnorm, B, r, latent_w, latent_bf16, latent_eps, lnorm, use_simd);  /* row by row: in place is safe */
    for (int64_t b = 0; b < B; b++) {
        memcpy(ckv[b] + (len[b] - 1) * r, lnorm + b * r, (size_t)r * sizeof *lnorm);
        memcpy(krot[b] + (len[b] - 1) * rope, kv + b * kvw + r, (size_t)rope * sizeof *kv);
    }
    for (int64_t hd = 0; hd < nh; hd++)
        for (int64_t b = 0; b < B; b++) {
            const float *qbh = q + b * qw + hd * (nope + rope);
            memcpy(qn + (hd * B + b) * nope, qbh, (size_t)nope * sizeof *qn);
            memcpy(qr + (b * nh + hd) * rope, qbh + nope, (size_t)rope * sizeof *qr);
        }
    for (int64_t hd = 0; hd < nh; hd++) xs[hd] = qn + hd * B * nope, ys[hd] = ql + hd * B * r, rows[hd] = B;
    rc = dense_gemv_t_items_f32(xs, rows, wk, sk, ys, nh, nope, r, kindk, groupk, threads, use_simd);
    if (rc) goto done;
    for (int64_t hd = 0; hd < nh; hd++)
        for (int64_t b = 0; b < B; b++) memcpy(qlb + (b * nh + hd) * r, ql + (hd * B + b) * r, (size_t)r * sizeof *ql);
    rc = mla_decode_attend_f32(B, qlb, qr, (const float *const *)ckv, (const float *const *)krot, len, scale, lat,
                               nh, r, rope, threads);
    if (rc) goto done;
    for (int64_t hd = 0; hd < nh; hd++)
        for (int64_t b = 0; b < B; b++) memcpy(lath + (hd * B + b) * r, lat + (b * nh + hd) * r, (size_t)r * sizeof *lat);
    for (int64_t hd = 0; hd < nh; hd++) xs[hd] = lath + hd * B * r, ys[hd] = vals + hd * B * dv;
    rc = dense_gemv_items_f32(xs, rows, wv, sv, ys, nh, dv, r, kindv, groupv, threads, use_simd);
    if (rc) goto done;
    for (int64_t b = 0; b < B; b++)
        for (int64_t hd = 0; hd < nh; hd++) memcpy(o + (b * nh + hd) * dv, vals + (hd * B + b) * dv, (size_t)dv * sizeof *o);
    float *yo[1] = {y};
    rc = dense_gemv_outs_f32(o, B, &wo, &so, yo, 1, one_out, nh * dv, kindo, groupo, threads, use_simd);
    if (rc) goto done;
    for (int64_t i = 0; i < B * H; i++) out[i] = h[i] + y[i];
done:
    free(x), free(q), free(kv), free(lnorm), free(qn), free(ql), free(qlb), free(qr), free(lat), free(lath);
    free(vals), free(o), free(y), free(xs), free(ys), free(rows);
    return rc;
}

/* ------------------------------------------------------------------ memory read probe */

/* Bytes of one claim: large enough that claiming costs nothing, small enough that a thread woken
   late takes fewer. */
#define READ_PIECE (1 << 20)

struct mem_read {
    const uint8_t *const *ptr;
    const int64_t *len;
    int64_t pieces;
    const int64_t *first;  /* first[i]: the pieces before buffer i */
    int64_t next;          /* the next piece to claim (atomic) */
    uint64_t sum;          /* every thread's sum added here (atomic) */
};

/* The sum of bytes p[0..n-1] taken as unsigned 64-bit words in the machine's order (the last n % 8
   bytes one by one): every byte is
   loaded once, as a weight product loads it, and the sum keeps the loads from being dropped. */
static uint64_t sum_bytes_portable(const uint8_t *p, int64_t n) {
    uint64_t a = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t u;
        memcpy(&u, p + i, 8);
        a += u;
    }
    for (; i < n; i++) a += p[i];
    return a;
}

#ifdef KERNELS_X86
/* The same sum with 32-byte loads into four accumulators of 64-bit lanes (as many loads in flight
   as the gemvs' row blocks keep). */
static AVX2 uint64_t sum_bytes_avx2(const uint8_t *p, int64_t n) {
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    int64_t i = 0;
    for (; i + 128 <= n; i += 128)
        for (int q = 0; q < 4; q++) acc[q] = _mm256_add_epi64(acc[q], _mm256_loadu_si256((const __m256i *)(p + i + 32 * q)));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3])));
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + sum_bytes_portable(p + i, n - i);
}
#endif

static void *run_mem_read(void *arg) {
    struct mem_read *mr = (struct mem_read *)arg;
    uint64_t (*sum)(const uint8_t *, int64_t) = sum_bytes_portable;
#ifdef KERNELS_X86
    if (have_avx2()) sum = sum_bytes_avx2;
#endif
    uint64_t total = 0;
    int64_t buf = 0;
    for (;;) {
        const int64_t k = __atomic_fetch_add(&mr->next, 1, __ATOMIC_RELAXED);
        if (k >= mr->pieces) break;
        while (mr->first[buf + 1] <= k) buf++;  /* pieces are claimed in increasing order */
        const int64_t at = (k - mr->first[buf]) * READ_PIECE, left = mr->len[buf] - at;
        total += sum(mr->ptr[buf] + at, left < READ_PIECE ? left : READ_PIECE);
    }
    __atomic_fetch_add(&mr->sum, total, __ATOMIC_RELAXED);
    return NULL;
}

/* Reads `count` buffers (ptr[i], len[i] bytes) once, in 1 MiB pieces that up to `threads` threads
   claim as they come free, and stores the sum of their 8-byte words in the machine's order (each
   buffer's last len % 8 bytes added one by one) modulo 2^64 in *sum: a probe of how fast these threads read this
   memory. Returns 0, or -1 when out of memory. */
int read_memory(const uint8_t *const *ptr, const int64_t *len, int64_t count, int threads, uint64_t *sum) {
    int64_t *first = malloc((size_t)(count + 1) * sizeof *first);
    if (!first) return -1;
    first[0] = 0;
    for (int64_t i = 0; i < count; i++) first[i + 1] = first[i] + (len[i] + READ_PIECE - 1) / READ_PIECE;
    struct mem_read mr = {ptr, len, first[count], first, 0, 0};
    int64_t t = threads < 1 ? 1 : threads;
    if (t > mr.pieces) t = mr.pieces > 0 ? mr.pieces : 1;
    run_parallel(run_mem_read, &mr, 0, (int)t);
    *sum = mr.sum;
    free(first);
    return 0;
}
