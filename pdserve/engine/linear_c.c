/* fp32 linear layers for small batches on CPU: y[M,N] = x[M,K] . W[N,K]^T.
 *
 * linear_cpu.py packs W once, at load, into panels of NR = 48 output columns,
 * P[ceil(N/NR)][K][NR] (columns past N are zero), and calls sg_linear through ctypes; this file
 * needs only the compiler (AVX-512F intrinsics, OpenMP when the compiler has it), no Python or
 * torch headers.
 *
 * Why: at decode batch sizes (M of 1 to a few dozen rows) a linear layer streams its weights
 * once per step. The micro-kernel keeps an MR x 48 tile of y in 3*MR zmm registers (MR <= 8),
 * loads three weight vectors per k, broadcasts each x[m][k] and issues 3*MR FMAs, with a
 * software prefetch PF_K steps ahead so the weight stream keeps the memory bus busy; rows past
 * 8 reuse the same panel from L2. Each output is one fp32 FMA chain over k in order (a fixed
 * summation order: results differ from other GEMMs only by rounding).
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

int lc_abi(void) { return 1; }
int lc_nr(void) { return NR; }

int lc_supported(void)
{
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") ? 1 : 0;
    }
    return known;
}

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
                     int64_t ldy)                                                               \
{                                                                                              \
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

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t);
static const tile_fn TILES[MR_MAX + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7,
                                          tile8};

/* One panel (NR columns from n0) for every row of x. */
static void panel(const float *x, int64_t M, int64_t K, const float *pj, int64_t N, int64_t n0,
                  float *y)
{
    const int64_t nv = N - n0 < NR ? N - n0 : NR;
    for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
        const int64_t mr = M - m0 < MR_MAX ? M - m0 : MR_MAX;
        if (nv == NR) {
            TILES[mr](x + m0 * K, K, pj, K, y + m0 * N + n0, N);
        } else { /* the last, partial panel: through a scratch tile */
            float tmp[MR_MAX * NR];
            TILES[mr](x + m0 * K, K, pj, K, tmp, NR);
            for (int64_t m = 0; m < mr; m++)
                memcpy(y + (m0 + m) * N + n0, tmp + m * NR, (size_t)nv * sizeof(float));
        }
    }
}

/* x: M x K row-major; p: the packed weight; y: M x N row-major. Returns 0, or -1 when this CPU
 * has no AVX-512F (the caller checks lc_supported first). */
int sg_linear(const float *x, int64_t M, int64_t K, const float *p, int64_t N, float *y,
              int nthreads)
{
    if (!lc_supported())
        return -1;
    const int64_t np = (N + NR - 1) / NR;
#ifdef _OPENMP
    if (nthreads > 1) {
        /* guided, not static: a thread that loses its core to another process for a while
         * (workers of one host lend each other cores) leaves its panels to the others */
        #pragma omp parallel for num_threads(nthreads) schedule(guided)
        for (int64_t j = 0; j < np; j++)
            panel(x, M, K, p + j * K * NR, N, j * NR, y);
        return 0;
    }
#endif
    (void)nthreads;
    for (int64_t j = 0; j < np; j++)
        panel(x, M, K, p + j * K * NR, N, j * NR, y);
    return 0;
}
