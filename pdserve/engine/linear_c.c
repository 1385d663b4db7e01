/* fp32 linear layers for small batches on CPU: y[M,N] = x[M,K] . W[N,K]^T.
 *
 * linear_cpu.py packs W once, at load, into panels of NR output columns,
 * P[ceil(N/NR)][K][NR] (columns past N are zero), and calls sg_linear through ctypes; this file
 * needs only the compiler (AVX-512F or AVX2+FMA intrinsics, OpenMP when the compiler has it),
 * no Python or torch headers. NR depends on the CPU (lc_nr): 48 with AVX-512F, 24 with AVX2.
 *
 * Why: at decode batch sizes (M of 1 to a few dozen rows) a linear layer streams its weights
 * once per step. The AVX-512 micro-kernel keeps an MR x 48 tile of y in 3*MR zmm registers
 * (MR <= 8), loads three weight vectors per k, broadcasts each x[m][k] and issues 3*MR FMAs,
 * with a software prefetch PF_K steps ahead so the weight stream keeps the memory bus busy;
 * rows past 8 reuse the same panel from L2. The AVX2 one is the same with 16 ymm registers: an
 * MR x 24 tile (MR <= 4: 12 accumulators, three weight vectors, one broadcast). Each output is
 * one fp32 FMA chain over k in order (a fixed summation order: results differ from other GEMMs
 * only by rounding).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NR 48
#define MR_MAX 8
#define PF_K 48 /* prefetch distance in k steps (48 x 192 bytes ahead), measured best here */
#define NR2 24  /* the AVX2 panel */
#define MR2_MAX 4
#define PF_K2 64 /* 64 x 96 bytes ahead */
#ifndef KB2
#define KB2 64 /* k steps of a panel slice the AVX2 row tiles share: 6 KB */
#endif
#ifndef KB2_MAX_ROWS
#define KB2_MAX_ROWS 64 /* more rows: each slice's pass over them costs more than L1 saves */
#endif

int lc_abi(void) { return 2; }

/* 2: AVX-512F, 1: AVX2 with FMA, 0: neither (the kernel does not run). */
int lc_supported(void)
{
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") ? 2
              : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 1 : 0;
    }
    return known;
}

int lc_nr(void) { return lc_supported() == 2 ? NR : NR2; }

#define ROWS1(X) X(0)
#define ROWS2(X) ROWS1(X) X(1)
#define ROWS3(X) ROWS2(X) X(2)
#define ROWS4(X) ROWS3(X) X(3)
#define ROWS5(X) ROWS4(X) X(4)
#define ROWS6(X) ROWS5(X) X(5)
#define ROWS7(X) ROWS6(X) X(6)
#define ROWS8(X) ROWS7(X) X(7)

#define DECL(m) __m512 c##m##a = _mm512_setzero_ps(), c##m##b = _mm512_setzero_ps(), \
                       c##m##c = _mm512_setzero_ps();
#define FMA(m) { const __m512 xb = _mm512_set1_ps(x[(m) * ldx + k]); \
                 c##m##a = _mm512_fmadd_ps(xb, w0, c##m##a); \
                 c##m##b = _mm512_fmadd_ps(xb, w1, c##m##b); \
                 c##m##c = _mm512_fmadd_ps(xb, w2, c##m##c); }
#define STORE(m) _mm512_storeu_ps(y + (m) * ldy, c##m##a); \
                 _mm512_storeu_ps(y + (m) * ldy + 16, c##m##b); \
                 _mm512_storeu_ps(y + (m) * ldy + 32, c##m##c);

#define KERNEL(MR)                                                                             \
__attribute__((target("avx512f,fma")))                                                         \
static void tile##MR(const float *x, int64_t ldx, const float *p, int64_t K, float *y,          \
                     int64_t ldy, int acc)                                                      \
{                                                                                              \
    (void)acc; /* always 0: the AVX-512 path runs each panel over the whole of K */           \
    ROWS##MR(DECL)                                                                             \
    for (int64_t k = 0; k < K; k++) {                                                          \
        const float *pk = p + k * NR;                                                          \
        _mm_prefetch((const char *)(pk + PF_K * NR), _MM_HINT_T0);                             \
        _mm_prefetch((const char *)(pk + PF_K * NR + 32), _MM_HINT_T0);                        \
        const __m512 w0 = _mm512_loadu_ps(pk);                                                 \
        const __m512 w1 = _mm512_loadu_ps(pk + 16);                                            \
        const __m512 w2 = _mm512_loadu_ps(pk + 32);                                            \
        ROWS##MR(FMA)                                                                          \
    }                                                                                          \
    ROWS##MR(STORE)                                                                            \
}

KERNEL(1) KERNEL(2) KERNEL(3) KERNEL(4) KERNEL(5) KERNEL(6) KERNEL(7) KERNEL(8)

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int);
static const tile_fn TILES[MR_MAX + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7,
                                          tile8};

#define DECL2(m) __m256 d##m##a = acc ? _mm256_loadu_ps(y + (m) * ldy) : _mm256_setzero_ps(), \
                        d##m##b = acc ? _mm256_loadu_ps(y + (m) * ldy + 8) : _mm256_setzero_ps(), \
                        d##m##c = acc ? _mm256_loadu_ps(y + (m) * ldy + 16) : _mm256_setzero_ps();
#define FMA2(m) { const __m256 xb = _mm256_broadcast_ss(x + (m) * ldx + k); \
                  d##m##a = _mm256_fmadd_ps(xb, w0, d##m##a); \
                  d##m##b = _mm256_fmadd_ps(xb, w1, d##m##b); \
                  d##m##c = _mm256_fmadd_ps(xb, w2, d##m##c); }
#define STORE2(m) _mm256_storeu_ps(y + (m) * ldy, d##m##a); \
                  _mm256_storeu_ps(y + (m) * ldy + 8, d##m##b); \
                  _mm256_storeu_ps(y + (m) * ldy + 16, d##m##c);

#define KERNEL2(MR)                                                                            \
__attribute__((target("avx2,fma")))                                                            \
static void tile2_##MR(const float *x, int64_t ldx, const float *p, int64_t K, float *y,        \
                       int64_t ldy, int acc)                                                    \
{                                                                                              \
    ROWS##MR(DECL2)                                                                            \
    for (int64_t k = 0; k < K; k++) {                                                          \
        const float *pk = p + k * NR2;                                                         \
        _mm_prefetch((const char *)(pk + PF_K2 * NR2), _MM_HINT_T0);                           \
        _mm_prefetch((const char *)(pk + PF_K2 * NR2 + 16), _MM_HINT_T0);                      \
        const __m256 w0 = _mm256_loadu_ps(pk);                                                 \
        const __m256 w1 = _mm256_loadu_ps(pk + 8);                                             \
        const __m256 w2 = _mm256_loadu_ps(pk + 16);                                            \
        ROWS##MR(FMA2)                                                                         \
    }                                                                                          \
    ROWS##MR(STORE2)                                                                           \
}

KERNEL2(1) KERNEL2(2) KERNEL2(3) KERNEL2(4)

static const tile_fn TILES2[MR2_MAX + 1] = {0, tile2_1, tile2_2, tile2_3, tile2_4};

/* One panel (nr columns from n0) for every row of x, in tiles of at most mr_max rows. With
 * kb < K (sg_linear decides: AVX2 and at most KB2_MAX_ROWS rows) and more rows than one tile, a
 * full panel is run kb steps of k at a time for every row tile, so the slice of the panel the
 * tiles share stays in L1; each tile carries its partial sums in y from one slice to the next,
 * so every output is still one FMA chain over k in order. */
static void panel(const float *x, int64_t M, int64_t K, const float *pj, int64_t N, int64_t n0,
                  float *y, int64_t nr, int64_t mr_max, const tile_fn *tiles, int64_t kb)
{
    const int64_t nv = N - n0 < nr ? N - n0 : nr;
    if (nv == nr && M > mr_max && kb < K) {
        for (int64_t k0 = 0; k0 < K; k0 += kb) {
            const int64_t kn = K - k0 < kb ? K - k0 : kb;
            for (int64_t m0 = 0; m0 < M; m0 += mr_max) {
                const int64_t mr = M - m0 < mr_max ? M - m0 : mr_max;
                tiles[mr](x + m0 * K + k0, K, pj + k0 * nr, kn, y + m0 * N + n0, N, k0 > 0);
            }
        }
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += mr_max) {
        const int64_t mr = M - m0 < mr_max ? M - m0 : mr_max;
        if (nv == nr) {
            tiles[mr](x + m0 * K, K, pj, K, y + m0 * N + n0, N, 0);
        } else { /* the last, partial panel: through a scratch tile */
            float tmp[MR_MAX * NR];
            tiles[mr](x + m0 * K, K, pj, K, tmp, nr, 0);
            for (int64_t m = 0; m < mr; m++)
                memcpy(y + (m0 + m) * N + n0, tmp + m * nr, (size_t)nv * sizeof(float));
        }
    }
}

/* x: M x K row-major; p: the packed weight (panels of lc_nr() columns); y: M x N row-major.
 * Returns 0, or -1 when this CPU has neither AVX-512F nor AVX2+FMA (the caller checks
 * lc_supported first). */
int sg_linear(const float *x, int64_t M, int64_t K, const float *p, int64_t N, float *y,
              int nthreads)
{
    const int isa = lc_supported();
    if (!isa)
        return -1;
    const int64_t nr = isa == 2 ? NR : NR2, mr_max = isa == 2 ? MR_MAX : MR2_MAX;
    const tile_fn *tiles = isa == 2 ? TILES : TILES2;
    const int64_t kb = isa == 2 || M > KB2_MAX_ROWS ? K : KB2;
    const int64_t np = (N + nr - 1) / nr;
#ifdef _OPENMP
    if (nthreads > 1) {
        /* guided, not static: a thread that loses its core to another process for a while
         * (workers of one host lend each other cores) leaves its panels to the others */
        #pragma omp parallel for num_threads(nthreads) schedule(guided)
        for (int64_t j = 0; j < np; j++)
            panel(x, M, K, p + j * K * nr, N, j * nr, y, nr, mr_max, tiles, kb);
        return 0;
    }
#endif
    (void)nthreads;
    for (int64_t j = 0; j < np; j++)
        panel(x, M, K, p + j * K * nr, N, j * nr, y, nr, mr_max, tiles, kb);
    return 0;
}
