/* int8 weight-only linear layers on CPU: y[M,N] = (x[M,K] . Q[N,K]^T) * s[N].
 *
 * Q holds each weight row quantized symmetrically to int8 with one fp32 scale per output
 * channel (s[n] = max|W[n,:]| / 127); x and y stay fp32. linear_int8.py packs Q once, at load,
 * into panels of NR output columns, P[ceil(N/NR)][K][NR] int8 (columns past N are zero), and
 * calls li8_linear through ctypes; this file needs only the compiler (AVX-512F or AVX2+FMA
 * intrinsics, OpenMP when the compiler has it), no Python or torch headers. It owns the product
 * only; it must not allocate, quantize or choose weights (linear_int8.py and model.py do).
 *
 * Why: at decode batch sizes a linear layer streams its weights once per step, so a quarter of
 * the bytes is the whole point. The micro-kernel is the fp32 one of linear_c.c with the weight
 * loads widened on the fly: per k, NR int8 weights are sign-extended to int32 and converted to
 * fp32 (exact), then broadcast x values FMA into an MR x NR tile of accumulators; the scale
 * multiplies each column once, at the end. Each output is one fp32 FMA chain over k in order, so
 * the result equals x . (Q * s)^T up to rounding. Rows past one tile run the panel in slices of
 * KB k steps, every row tile per slice, so the slice stays in L1 while the tiles share it.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NR 48   /* AVX-512: three zmm of 16 columns */
#define MR_MAX 8
#define NR2 24  /* AVX2: three ymm of 8 columns */
#define MR2_MAX 4
#define PF_K 96 /* prefetch distance in k steps (96 x NR bytes ahead) */
#define KB 128  /* k steps of a panel slice the row tiles share */

int li8_abi(void) { return 1; }

/* 2: AVX-512F, 1: AVX2 with FMA, 0: neither (the kernel does not run). */
int li8_supported(void)
{
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") ? 2
              : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 1 : 0;
    }
    return known;
}

int li8_nr(int isa) { return isa == 2 ? NR : NR2; }

#define ROWS1(X) X(0)
#define ROWS2(X) ROWS1(X) X(1)
#define ROWS3(X) ROWS2(X) X(2)
#define ROWS4(X) ROWS3(X) X(3)
#define ROWS5(X) ROWS4(X) X(4)
#define ROWS6(X) ROWS5(X) X(5)
#define ROWS7(X) ROWS6(X) X(6)
#define ROWS8(X) ROWS7(X) X(7)

/* acc: add to the partial sums already in y; s != NULL: this is the last slice, scale on store */
#define DECL(m) __m512 c##m##a = acc ? _mm512_loadu_ps(y + (m) * ldy) : _mm512_setzero_ps(), \
                       c##m##b = acc ? _mm512_loadu_ps(y + (m) * ldy + 16) : _mm512_setzero_ps(), \
                       c##m##c = acc ? _mm512_loadu_ps(y + (m) * ldy + 32) : _mm512_setzero_ps();
#define FMA(m) { const __m512 xb = _mm512_set1_ps(x[(m) * ldx + k]); \
                 c##m##a = _mm512_fmadd_ps(xb, w0, c##m##a); \
                 c##m##b = _mm512_fmadd_ps(xb, w1, c##m##b); \
                 c##m##c = _mm512_fmadd_ps(xb, w2, c##m##c); }
#define SCALE(m) c##m##a = _mm512_mul_ps(c##m##a, s0); c##m##b = _mm512_mul_ps(c##m##b, s1); \
                 c##m##c = _mm512_mul_ps(c##m##c, s2);
#define STORE(m) _mm512_storeu_ps(y + (m) * ldy, c##m##a); \
                 _mm512_storeu_ps(y + (m) * ldy + 16, c##m##b); \
                 _mm512_storeu_ps(y + (m) * ldy + 32, c##m##c);
#define WIDEN512(off) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32( \
                          _mm_loadu_si128((const __m128i *)(pk + (off)))))

#define KERNEL(MR)                                                                             \
__attribute__((target("avx512f,fma")))                                                         \
static void tile##MR(const float *x, int64_t ldx, const int8_t *p, int64_t K, float *y,         \
                     int64_t ldy, int acc, const float *s)                                      \
{                                                                                              \
    ROWS##MR(DECL)                                                                             \
    for (int64_t k = 0; k < K; k++) {                                                          \
        const int8_t *pk = p + k * NR;                                                         \
        _mm_prefetch((const char *)(pk + PF_K * NR), _MM_HINT_T0);                             \
        const __m512 w0 = WIDEN512(0), w1 = WIDEN512(16), w2 = WIDEN512(32);                   \
        ROWS##MR(FMA)                                                                          \
    }                                                                                          \
    if (s) {                                                                                   \
        const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16),                    \
                     s2 = _mm512_loadu_ps(s + 32);                                             \
        ROWS##MR(SCALE)                                                                        \
    }                                                                                          \
    ROWS##MR(STORE)                                                                            \
}

KERNEL(1) KERNEL(2) KERNEL(3) KERNEL(4) KERNEL(5) KERNEL(6) KERNEL(7) KERNEL(8)

typedef void (*tile_fn)(const float *, int64_t, const int8_t *, int64_t, float *, int64_t, int,
                        const float *);
static const tile_fn TILES[MR_MAX + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7,
                                          tile8};

#define DECL2(m) __m256 d##m##a = acc ? _mm256_loadu_ps(y + (m) * ldy) : _mm256_setzero_ps(), \
                        d##m##b = acc ? _mm256_loadu_ps(y + (m) * ldy + 8) : _mm256_setzero_ps(), \
                        d##m##c = acc ? _mm256_loadu_ps(y + (m) * ldy + 16) : _mm256_setzero_ps();
#define FMA2(m) { const __m256 xb = _mm256_broadcast_ss(x + (m) * ldx + k); \
                  d##m##a = _mm256_fmadd_ps(xb, w0, d##m##a); \
                  d##m##b = _mm256_fmadd_ps(xb, w1, d##m##b); \
                  d##m##c = _mm256_fmadd_ps(xb, w2, d##m##c); }
#define SCALE2(m) d##m##a = _mm256_mul_ps(d##m##a, s0); d##m##b = _mm256_mul_ps(d##m##b, s1); \
                  d##m##c = _mm256_mul_ps(d##m##c, s2);
#define STORE2(m) _mm256_storeu_ps(y + (m) * ldy, d##m##a); \
                  _mm256_storeu_ps(y + (m) * ldy + 8, d##m##b); \
                  _mm256_storeu_ps(y + (m) * ldy + 16, d##m##c);
#define WIDEN256(off) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32( \
                          _mm_loadl_epi64((const __m128i *)(pk + (off)))))

#define KERNEL2(MR)                                                                            \
__attribute__((target("avx2,fma")))                                                            \
static void tile2_##MR(const float *x, int64_t ldx, const int8_t *p, int64_t K, float *y,       \
                       int64_t ldy, int acc, const float *s)                                    \
{                                                                                              \
    ROWS##MR(DECL2)                                                                            \
    for (int64_t k = 0; k < K; k++) {                                                          \
        const int8_t *pk = p + k * NR2;                                                        \
        _mm_prefetch((const char *)(pk + PF_K * NR2), _MM_HINT_T0);                            \
        const __m256 w0 = WIDEN256(0), w1 = WIDEN256(8), w2 = WIDEN256(16);                    \
        ROWS##MR(FMA2)                                                                         \
    }                                                                                          \
    if (s) {                                                                                   \
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8),                    \
                     s2 = _mm256_loadu_ps(s + 16);                                             \
        ROWS##MR(SCALE2)                                                                       \
    }                                                                                          \
    ROWS##MR(STORE2)                                                                           \
}

KERNEL2(1) KERNEL2(2) KERNEL2(3) KERNEL2(4)

static const tile_fn TILES2[MR2_MAX + 1] = {0, tile2_1, tile2_2, tile2_3, tile2_4};

/* One panel (nr columns from n0, their scales at s) for every row of x. A partial last panel
 * goes through a scratch tile (its padded scales are read from sp, zero past N). */
static void panel(const float *x, int64_t M, int64_t K, const int8_t *pj, const float *sp,
                  int64_t N, int64_t n0, float *y, int64_t nr, int64_t mr_max,
                  const tile_fn *tiles)
{
    const int64_t nv = N - n0 < nr ? N - n0 : nr;
    if (nv == nr && M > mr_max && K > KB) {
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
            const int64_t kn = K - k0 < KB ? K - k0 : KB;
            const float *s = k0 + kn == K ? sp : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += mr_max) {
                const int64_t mr = M - m0 < mr_max ? M - m0 : mr_max;
                tiles[mr](x + m0 * K + k0, K, pj + k0 * nr, kn, y + m0 * N + n0, N, k0 > 0, s);
            }
        }
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += mr_max) {
        const int64_t mr = M - m0 < mr_max ? M - m0 : mr_max;
        if (nv == nr) {
            tiles[mr](x + m0 * K, K, pj, K, y + m0 * N + n0, N, 0, sp);
        } else { /* the last, partial panel: through a scratch tile */
            float tmp[MR_MAX * NR];
            tiles[mr](x + m0 * K, K, pj, K, tmp, nr, 0, sp);
            for (int64_t m = 0; m < mr; m++)
                memcpy(y + (m0 + m) * N + n0, tmp + m * nr, (size_t)nv * sizeof(float));
        }
    }
}

/* x: M x K row-major fp32; p: the packed int8 weight (panels of li8_nr(isa) columns); s: the
 * scales, padded with zeros to a whole number of panels; y: M x N row-major fp32. isa 0 picks
 * the best this CPU has; 1 or 2 forces AVX2 or AVX-512 (tests run both). Returns 0, or -1 when
 * the asked instruction set is missing. */
int li8_linear(const float *x, int64_t M, int64_t K, const int8_t *p, const float *s, int64_t N,
               float *y, int nthreads, int isa)
{
    const int have = li8_supported();
    if (isa == 0)
        isa = have;
    if (isa < 1 || isa > have)
        return -1;
    const int64_t nr = isa == 2 ? NR : NR2, mr_max = isa == 2 ? MR_MAX : MR2_MAX;
    const tile_fn *tiles = isa == 2 ? TILES : TILES2;
    const int64_t np = (N + nr - 1) / nr;
#ifdef _OPENMP
    if (nthreads > 1) {
        /* guided, as linear_c.c: a thread that loses its core for a while leaves its panels */
        #pragma omp parallel for num_threads(nthreads) schedule(guided)
        for (int64_t j = 0; j < np; j++)
            panel(x, M, K, p + j * K * nr, s + j * nr, N, j * nr, y, nr, mr_max, tiles);
        return 0;
    }
#endif
    (void)nthreads;
    for (int64_t j = 0; j < np; j++)
        panel(x, M, K, p + j * K * nr, s + j * nr, N, j * nr, y, nr, mr_max, tiles);
    return 0;
}
