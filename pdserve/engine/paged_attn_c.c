/* Paged attention for decode rows on CPU: K/V read in place from the paged cache.
 *
 * paged_attn_cpu.py compiles this file and calls it through ctypes; attention.py holds the
 * PyTorch reference it must equal. C99 with the GCC/clang vector extensions (+ OpenMP when the
 * compiler has it), no Python or torch headers.
 *
 * Layout. The cache of one layer is [slots, n_kv_heads, head_dim], slot = block * block_size +
 * offset. Queries and outputs are rows of [rows, n_heads, head_dim] (heads contiguous, a row
 * stride given). Sequence b owns q_len[b] consecutive rows from row_start[b]; its context is
 * ctx_len[b] keys (those rows' own keys included, already written) found through
 * tables[b * table_stride + position / block_size]. Query slot i of a span of Q sees keys
 * 0 .. ctx_len - Q + i (causal over the last Q positions); Q == 1 is a plain decode.
 *
 * Work. One item is (sequence, chunk of its blocks): every query head times the span's Q slots
 * are its rows; the query heads sharing a kv head (GQA) read each K/V vector once for all of
 * them, and each block (all kv heads of 16 or so slots: one contiguous run) is read front to
 * back once. Softmax is online per block (running max, running sum, rescaled accumulator). The
 * step is bound by reading K/V from memory, so the next block is prefetched while this one is
 * computed. With fewer sequences than twice the threads (small batches), each sequence's blocks
 * are cut into chunks whose partial results (max, sum, accumulator) are merged afterwards. Items
 * are handed out dynamically, which also keeps a thread the OS preempted from holding up the
 * call.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PA_ABI 1
#define PA_F32 1
#define PA_BF16 2

typedef struct {
    const int32_t *row_start; /* [nseq] first row of each span in q and out */
    const int32_t *q_len;     /* [nseq] query rows of each span (>= 1) */
    const int32_t *ctx_len;   /* [nseq] keys the span's last row sees (>= q_len) */
    const int32_t *tables;    /* [nseq, table_stride] block ids */
    int64_t table_stride, nseq, n_heads, n_kv_heads, head_dim, block_size;
    int64_t max_q;            /* the largest q_len (sizes the scratch) */
    int64_t split;            /* chunks per sequence; 0: chosen here from the batch */
    int64_t min_parallel_work; /* multiply-adds below which one thread runs the call */
    int64_t max_isa;          /* the widest build to use (see pa_isa); tests lower it */
    float scale;
    int32_t nthreads;
} pa_batch;

typedef struct { /* one layer's tensors; strides: elements between rows */
    const void *q;
    int64_t q_stride;
    const void *k, *v;
    void *out;
    int64_t out_stride;
} pa_layer;

#if defined(__GNUC__)
#define PA_INLINE static inline __attribute__((always_inline))
#else
#define PA_INLINE static inline
#endif

int pa_abi(void) { return PA_ABI; }

#ifdef _OPENMP
int pa_openmp(void) { return 1; }
#else
int pa_openmp(void) { return 0; }
#endif

PA_INLINE float bf16_load(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

PA_INLINE uint16_t bf16_store(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);         /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

PA_INLINE float ld(const void *p, int64_t i, const int dt)
{
    return dt == PA_F32 ? ((const float *)p)[i] : bf16_load(((const uint16_t *)p)[i]);
}

/* exp(x) for x <= 0 (a score minus the running max): Cody-Waite reduction and the Cephes
 * polynomial, within 2 ulp; written without libm calls so loops over it vectorize. */
PA_INLINE float pa_exp(float x)
{
    x = x < -87.0f ? -87.0f : x;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* Scratch floats one item needs for nr rows. */
static int64_t scratch_floats(int64_t nr, int64_t d, int64_t bs) { return nr * (2 * d + 2 + bs); }

/* VW floats as one value: GCC and clang lower it to what the function's target has; no
 * intrinsics, so one body serves every ISA build. VW is 16 (one AVX-512 register) by default;
 * paged_attn_cpu.py builds the library again with -DPA_VW=8 for CPUs without AVX-512, because
 * GCC lowers a 16-float value to two AVX2 registers badly (its lanes and accumulators travel
 * through the stack, several times slower). Loads and stores go through memcpy (unaligned, no
 * aliasing questions). */
#ifndef PA_VW
#define PA_VW 16
#endif
#if PA_VW != 16 && PA_VW != 8
#error "PA_VW must be 8 or 16"
#endif
#define VW PA_VW
typedef float vfw __attribute__((vector_size(4 * VW)));
typedef uint16_t vu16 __attribute__((vector_size(2 * VW)));
typedef uint32_t vu32 __attribute__((vector_size(4 * VW)));

int pa_vector_width(void) { return VW; }

PA_INLINE vfw vload(const void *p, int64_t i, const int dt)
{
    vfw x;
    if (dt == PA_F32) {
        memcpy(&x, (const float *)p + i, sizeof x);
    } else {
        vu16 h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        vu32 w = __builtin_convertvector(h, vu32) << 16;
        memcpy(&x, &w, sizeof x);
    }
    return x;
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define PA_HAS_SHUFFLE 1
#endif
#endif

/* x in every lane. A plain `x * v` has GCC build the broadcast on the stack, lane by lane,
 * where the target's registers are narrower than the vector; a shuffle of a short vector
 * lowers to one broadcast instruction. */
PA_INLINE vfw splat(float x)
{
#ifdef PA_HAS_SHUFFLE
    typedef float vf4 __attribute__((vector_size(16)));
    const vf4 s = {x, x, x, x};
#if VW == 16
    return __builtin_shufflevector(s, s, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
#else
    return __builtin_shufflevector(s, s, 0, 1, 2, 3, 0, 1, 2, 3);
#endif
#else
    return x + (vfw){0};
#endif
}

/* The sums of four vectors' lanes, out[u] = sum of a_u: folded together (about five operations
 * a sum instead of ten one by one). */
PA_INLINE void hsum4(vfw a0, vfw a1, vfw a2, vfw a3, float *out)
{
#ifdef PA_HAS_SHUFFLE
    typedef float vf8 __attribute__((vector_size(32)));
    typedef float vf4 __attribute__((vector_size(16)));
#if VW == 16
#define PA_FOLD(a) (__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + \
                    __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15))
    const vf8 b0 = PA_FOLD(a0), b1 = PA_FOLD(a1), b2 = PA_FOLD(a2), b3 = PA_FOLD(a3);
#undef PA_FOLD
#else
    const vf8 b0 = a0, b1 = a1, b2 = a2, b3 = a3;
#endif
    /* c01 = [b0[0]+b0[1], b1[0]+b1[1], b0[2]+b0[3], b1[2]+b1[3], ...] */
    const vf8 c01 = __builtin_shufflevector(b0, b1, 0, 8, 2, 10, 4, 12, 6, 14) +
                    __builtin_shufflevector(b0, b1, 1, 9, 3, 11, 5, 13, 7, 15);
    const vf8 c23 = __builtin_shufflevector(b2, b3, 0, 8, 2, 10, 4, 12, 6, 14) +
                    __builtin_shufflevector(b2, b3, 1, 9, 3, 11, 5, 13, 7, 15);
    /* d[u] = a_u's lanes 0-3 (of the folded 8), d[4 + u] = lanes 4-7 */
    const vf8 d = __builtin_shufflevector(c01, c23, 0, 1, 8, 9, 4, 5, 12, 13) +
                  __builtin_shufflevector(c01, c23, 2, 3, 10, 11, 6, 7, 14, 15);
    const vf4 e = __builtin_shufflevector(d, d, 0, 1, 2, 3) + __builtin_shufflevector(d, d, 4, 5, 6, 7);
    memcpy(out, &e, sizeof e);
#else
    const vfw *a[4] = {&a0, &a1, &a2, &a3};
    for (int u = 0; u < 4; u++) {
        out[u] = 0.0f;
        for (int i = 0; i < VW; i++)
            out[u] += (*a[u])[i];
    }
#endif
}

/* Ask for the K and V of slots [slot0, slot0 + n) (every kv head) ahead of use: a block's
 * slots are one contiguous run, but the next block is anywhere, which no prefetcher guesses. */
PA_INLINE void prefetch_slots(const pa_batch *bt, const pa_layer *ly, int64_t slot0, int64_t n,
                              const int dt)
{
    const int64_t row = bt->n_kv_heads * bt->head_dim * (dt == PA_F32 ? 4 : 2);
    const char *k = (const char *)ly->k + slot0 * row, *v = (const char *)ly->v + slot0 * row;
    for (int64_t o = 0; o < n * row; o += 64) {
        __builtin_prefetch(k + o, 0, 3);
        __builtin_prefetch(v + o, 0, 3);
    }
}

/* Query rows: r = query slot * n_heads + head; a kv head h serves heads h*G .. h*G + G-1. */
#define PA_ROWS_OF(h)                                                                             \
    for (int64_t i = 0; i < Q; i++)                                                               \
        for (int64_t g = 0, r = i * H + h * G; g < G; g++, r++)

/* s[r][t] = q_r . k_t for the n slots from slot0, four keys at a time (a block's last 0-3 keys
 * padded with its first, their scores unused); the n slots from `next` are prefetched meanwhile,
 * one per key, so the requests overlap this block's work instead of queueing in one burst. */
PA_INLINE void block_scores(const pa_batch *bt, const pa_layer *ly, const float *qv, float *s,
                            int64_t slot0, int64_t n, int64_t next, int64_t next_n, int64_t Q,
                            const int64_t D, const int dt)
{
    const int64_t H = bt->n_heads, HK = bt->n_kv_heads, G = H / HK, BS = bt->block_size;
    const int64_t DV = D - D % VW;
    for (int64_t t = 0; t < n; t += 4) {
        for (int64_t u = t; u < t + 4 && u < next_n; u++)
            prefetch_slots(bt, ly, next + u, 1, dt);
        int64_t ko[4];
        for (int64_t u = 0; u < 4; u++)
            ko[u] = (slot0 + (t + u < n ? t + u : 0)) * HK * D;
        for (int64_t h = 0; h < HK; h++)
            PA_ROWS_OF(h) {
                const float *qr = qv + r * D;
                vfw a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int64_t d = 0; d < DV; d += VW) {
                    vfw x;
                    memcpy(&x, qr + d, sizeof x);
                    a0 += x * vload(ly->k, ko[0] + h * D + d, dt);
                    a1 += x * vload(ly->k, ko[1] + h * D + d, dt);
                    a2 += x * vload(ly->k, ko[2] + h * D + d, dt);
                    a3 += x * vload(ly->k, ko[3] + h * D + d, dt);
                }
                float sum[4];
                hsum4(a0, a1, a2, a3, sum);
                for (int64_t u = 0; u < 4 && t + u < n; u++) {
                    for (int64_t d = DV; d < D; d++)
                        sum[u] += qr[d] * ld(ly->k, ko[u] + h * D + d, dt);
                    s[r * BS + t + u] = sum[u];
                }
            }
    }
}

/* acc_r += sum over the block's keys of s[r][t] v_t: each row's accumulator stays in registers
 * across the keys, four vectors (64 dims) at a time, then one, then single dims. */
PA_INLINE void block_values(const pa_batch *bt, const pa_layer *ly, const float *s, float *acc,
                            int64_t slot0, int64_t n, int64_t Q, const int64_t D, const int dt)
{
    const int64_t H = bt->n_heads, HK = bt->n_kv_heads, G = H / HK, BS = bt->block_size;
    const int64_t DV = D - D % VW, step = HK * D;
    for (int64_t h = 0; h < HK; h++)
        PA_ROWS_OF(h) {
            const float *sr = s + r * BS;
            float *ar = acc + r * D;
            const int64_t off = slot0 * step + h * D;
            int64_t d = 0;
            for (; d + 4 * VW <= DV; d += 4 * VW) {
                /* four named accumulators, not an array: GCC kept an array of them on the
                 * stack (without AVX-512), every add a store and a reload */
                vfw a0, a1, a2, a3;
                memcpy(&a0, ar + d, sizeof a0);
                memcpy(&a1, ar + d + VW, sizeof a1);
                memcpy(&a2, ar + d + 2 * VW, sizeof a2);
                memcpy(&a3, ar + d + 3 * VW, sizeof a3);
                for (int64_t t = 0; t < n; t++) {
                    const int64_t o = off + t * step + d;
                    const vfw w = splat(sr[t]);
                    a0 += w * vload(ly->v, o, dt);
                    a1 += w * vload(ly->v, o + VW, dt);
                    a2 += w * vload(ly->v, o + 2 * VW, dt);
                    a3 += w * vload(ly->v, o + 3 * VW, dt);
                }
                memcpy(ar + d, &a0, sizeof a0);
                memcpy(ar + d + VW, &a1, sizeof a1);
                memcpy(ar + d + 2 * VW, &a2, sizeof a2);
                memcpy(ar + d + 3 * VW, &a3, sizeof a3);
            }
            for (; d < DV; d += VW) {
                vfw a;
                memcpy(&a, ar + d, sizeof a);
                for (int64_t t = 0; t < n; t++)
                    a += splat(sr[t]) * vload(ly->v, off + t * step + d, dt);
                memcpy(ar + d, &a, sizeof a);
            }
            for (; d < D; d++)
                for (int64_t t = 0; t < n; t++)
                    ar[d] += sr[t] * ld(ly->v, off + t * step + d, dt);
        }
}

/* Row r of `out` (query slot r / n_heads of sequence b, head r % n_heads) = acc * inv. */
PA_INLINE void store_row(const pa_batch *bt, const pa_layer *ly, int64_t b, int64_t r,
                         const float *acc, float inv, int64_t D, const int dt)
{
    const int64_t H = bt->n_heads;
    const int64_t dst = (bt->row_start[b] + r / H) * ly->out_stride + (r % H) * D;
    for (int64_t d = 0; d < D; d++) {
        if (dt == PA_F32)
            ((float *)ly->out)[dst + d] = acc[d] * inv;
        else
            ((uint16_t *)ly->out)[dst + d] = bf16_store(acc[d] * inv);
    }
}

/* One item: every query row of sequence b over its blocks [j0, j1), each block read front to
 * back once while the next is prefetched. part == NULL: the item covers the whole context and
 * writes the normalised rows to out; else it writes per row (max, sum, accumulator[D]) to part,
 * to be merged. dconst: the head dim as a constant (its loops unroll), or 0. */
PA_INLINE void item_impl(const pa_batch *bt, const pa_layer *ly, int64_t b, int64_t j0,
                         int64_t j1, float *restrict scr, float *restrict part, const int dt,
                         const int64_t dconst)
{
    const int64_t D = dconst ? dconst : bt->head_dim;
    const int64_t H = bt->n_heads, BS = bt->block_size;
    const int64_t Q = bt->q_len[b], L = bt->ctx_len[b], NR = H * Q;
    const int32_t *table = bt->tables + b * bt->table_stride;
    float *restrict qv = scr, *restrict acc = qv + NR * D;
    float *restrict m = acc + NR * D, *restrict l = m + NR, *restrict s = l + NR;

    if (j0 < j1)
        prefetch_slots(bt, ly, (int64_t)table[j0] * BS, L - j0 * BS < BS ? L - j0 * BS : BS, dt);
    for (int64_t i = 0; i < Q; i++)
        for (int64_t e = 0; e < H * D; e++)
            qv[i * H * D + e] = ld(ly->q, (bt->row_start[b] + i) * ly->q_stride + e, dt) * bt->scale;
    for (int64_t r = 0; r < NR; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(acc, 0, (size_t)(NR * D) * sizeof(float));

    for (int64_t j = j0; j < j1; j++) {
        const int64_t p0 = j * BS, n = L - p0 < BS ? L - p0 : BS;
        const int64_t slot0 = (int64_t)table[j] * BS;
        const int64_t next = j + 1 < j1 ? (int64_t)table[j + 1] * BS : 0;
        const int64_t next_n = j + 1 < j1 ? (L - p0 - BS < BS ? L - p0 - BS : BS) : 0;
        block_scores(bt, ly, qv, s, slot0, n, next, next_n, Q, D, dt);
        /* Online softmax: s becomes the block's weights, m and l the running max and sum. */
        for (int64_t r = 0; r < NR; r++) {
            float *sr = s + r * BS;
            int64_t nv = L - Q + 1 + r / H - p0; /* keys of this block row r sees */
            nv = nv < n ? nv : n;
            float mx = m[r];
            for (int64_t t = 0; t < nv; t++)
                mx = sr[t] > mx ? sr[t] : mx;
            if (nv <= 0) {
                memset(sr, 0, (size_t)n * sizeof(float));
                continue;
            }
            const float alpha = m[r] == -INFINITY ? 0.0f : pa_exp(m[r] - mx);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                const float e = t < nv ? pa_exp(sr[t] - mx) : 0.0f;
                sr[t] = e;
                sum += e;
            }
            l[r] = l[r] * alpha + sum;
            m[r] = mx;
            if (alpha != 1.0f)
                for (int64_t d = 0; d < D; d++)
                    acc[r * D + d] *= alpha;
        }
        block_values(bt, ly, s, acc, slot0, n, Q, D, dt);
    }

    for (int64_t r = 0; r < NR; r++) {
        if (part == NULL) {
            store_row(bt, ly, b, r, acc + r * D, 1.0f / l[r], D, dt);
        } else {
            float *pr = part + r * (D + 2);
            pr[0] = m[r];
            pr[1] = l[r];
            memcpy(pr + 2, acc + r * D, (size_t)D * sizeof(float));
        }
    }
}

/* The partial results of sequence b over `split` chunks -> its output rows. */
static void merge(const pa_batch *bt, const pa_layer *ly, int64_t b, int64_t split,
                  const float *part, int64_t part_stride, int dt)
{
    const int64_t D = bt->head_dim;
    float o[D];
    for (int64_t r = 0; r < bt->n_heads * bt->q_len[b]; r++) {
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t c = 0; c < split; c++) {
            const float mc = part[c * part_stride + r * (D + 2)];
            mx = mc > mx ? mc : mx;
        }
        memset(o, 0, sizeof o);
        for (int64_t c = 0; c < split; c++) {
            const float *pr = part + c * part_stride + r * (D + 2);
            if (pr[0] == -INFINITY)
                continue; /* a chunk of keys this row does not see */
            const float w = pa_exp(pr[0] - mx);
            sum += w * pr[1];
            for (int64_t d = 0; d < D; d++)
                o[d] += w * pr[2 + d];
        }
        if (dt == PA_F32)
            store_row(bt, ly, b, r, o, 1.0f / sum, D, PA_F32);
        else
            store_row(bt, ly, b, r, o, 1.0f / sum, D, PA_BF16);
    }
}

/* Each item body built for baseline x86-64 and for AVX2+FMA / AVX-512, picked by CPU at run
 * time (one cached library, fast where the CPU allows, runs on any x86-64), and within each for
 * head dims 64 and 128 as constants (the common ones) and any other. Elsewhere (or with
 * -DPA_NO_ISA_VARIANTS) one baseline build. */
typedef void (*item_fn)(const pa_batch *, const pa_layer *, int64_t, int64_t, int64_t, float *,
                        float *);

#define PA_ITEM(name, attr, dt)                                                                  \
    attr static void name(const pa_batch *bt, const pa_layer *ly, int64_t b, int64_t j0,          \
                          int64_t j1, float *scr, float *part)                                    \
    {                                                                                             \
        if (bt->head_dim == 64)                                                                   \
            item_impl(bt, ly, b, j0, j1, scr, part, dt, 64);                                      \
        else if (bt->head_dim == 128)                                                             \
            item_impl(bt, ly, b, j0, j1, scr, part, dt, 128);                                     \
        else                                                                                      \
            item_impl(bt, ly, b, j0, j1, scr, part, dt, 0);                                       \
    }

PA_ITEM(item_f32, , PA_F32)
PA_ITEM(item_bf16, , PA_BF16)

#if defined(__x86_64__) && defined(__GNUC__) && !defined(PA_NO_ISA_VARIANTS)
#define PA_X86 1
PA_ITEM(item_f32_avx2, __attribute__((target("avx2,fma"))), PA_F32)
PA_ITEM(item_bf16_avx2, __attribute__((target("avx2,fma"))), PA_BF16)
PA_ITEM(item_f32_avx512, __attribute__((target("avx512f,avx2,fma"))), PA_F32)
PA_ITEM(item_bf16_avx512, __attribute__((target("avx512f,avx2,fma"))), PA_BF16)
#endif

/* Which build runs here: 0 baseline, 1 AVX2+FMA, 2 AVX-512. */
int pa_isa(void)
{
#ifdef PA_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return 1;
#endif
    return 0;
}

static item_fn pick(int dt, int64_t max_isa)
{
    const int64_t isa = pa_isa() < max_isa ? pa_isa() : max_isa;
#ifdef PA_X86
    if (isa == 2)
        return dt == PA_F32 ? item_f32_avx512 : item_bf16_avx512;
    if (isa == 1)
        return dt == PA_F32 ? item_f32_avx2 : item_bf16_avx2;
#endif
    (void)isa;
    return dt == PA_F32 ? item_f32 : item_bf16;
}

/* Threads for this batch: one below min_parallel_work multiply-adds (keys x query heads x head
 * dim), where a call takes tens of microseconds and waking threads (or, on a busy machine,
 * waiting for one the OS has parked) costs more than it saves. */
static int64_t choose_threads(const pa_batch *bt)
{
    int64_t work = 0;
    for (int64_t b = 0; b < bt->nseq; b++)
        work += (int64_t)bt->ctx_len[b] * bt->q_len[b];
    work *= bt->n_heads * bt->head_dim;
    return bt->nthreads > 1 && work >= bt->min_parallel_work ? bt->nthreads : 1;
}

/* Chunks per sequence: 1 when the sequences feed every thread twice over (or one thread runs);
 * else enough for about four items per thread, each chunk at least 4 blocks. */
static int64_t choose_split(const pa_batch *bt, int64_t nt)
{
    if (bt->split > 0)
        return bt->split;
    if (nt <= 1 || bt->nseq >= 2 * nt)
        return 1;
    int64_t maxblk = 0;
    for (int64_t b = 0; b < bt->nseq; b++) {
        const int64_t nb = (bt->ctx_len[b] + bt->block_size - 1) / bt->block_size;
        maxblk = nb > maxblk ? nb : maxblk;
    }
    int64_t split = (4 * nt + bt->nseq - 1) / bt->nseq;
    const int64_t cap = maxblk / 4 > 1 ? maxblk / 4 : 1;
    return split < cap ? split : cap;
}

/* Item it: sequence *b, its blocks [*j0, *j1). */
static void item_range(const pa_batch *bt, int64_t it, int64_t split, int64_t *b, int64_t *j0,
                       int64_t *j1)
{
    const int64_t BS = bt->block_size;
    *b = it / split;
    const int64_t c = it % split;
    const int64_t nblk = (bt->ctx_len[*b] + BS - 1) / BS;
    const int64_t per = (nblk + split - 1) / split;
    *j0 = c * per < nblk ? c * per : nblk;
    *j1 = *j0 + per < nblk ? *j0 + per : nblk;
}

/* Returns 0, or: 1 bad dtype, 2 bad shape, 3 bad span, 4 out of memory. */
int pa_decode(int dt, const pa_batch *bt, const void *q, int64_t q_stride, const void *k,
              const void *v, void *out, int64_t out_stride)
{
    if (dt != PA_F32 && dt != PA_BF16)
        return 1;
    if (bt->n_kv_heads <= 0 || bt->n_heads % bt->n_kv_heads != 0 || bt->head_dim <= 0 ||
        bt->block_size <= 0 || bt->max_q <= 0)
        return 2;
    for (int64_t b = 0; b < bt->nseq; b++)
        if (bt->q_len[b] < 1 || bt->q_len[b] > bt->max_q || bt->ctx_len[b] < bt->q_len[b] ||
            (bt->ctx_len[b] + bt->block_size - 1) / bt->block_size > bt->table_stride)
            return 3;
    if (bt->nseq == 0)
        return 0;
    const pa_layer ly = {q, q_stride, k, v, out, out_stride};
    const item_fn fn = pick(dt, bt->max_isa);
    const int64_t D = bt->head_dim, BS = bt->block_size;
    const int64_t nr_max = bt->n_heads * bt->max_q;
    const int nt = (int)choose_threads(bt);
    const int64_t split = choose_split(bt, nt);
    const int64_t items = bt->nseq * split;
    const int64_t part_stride = nr_max * (D + 2); /* floats per item's partial result */
    float *part = NULL;
    if (split > 1) {
        part = malloc((size_t)(items * part_stride) * sizeof(float));
        if (part == NULL)
            return 4;
    }
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1 && items > 1)
    {
        float *scr = malloc((size_t)scratch_floats(nr_max, D, BS) * sizeof(float));
        if (scr == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (scr == NULL)
                continue;
            int64_t b, j0, j1;
            item_range(bt, it, split, &b, &j0, &j1);
            fn(bt, &ly, b, j0, j1, scr, part == NULL ? NULL : part + it * part_stride);
        }
        if (part != NULL) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < bt->nseq; b++)
                if (!failed)
                    merge(bt, &ly, b, split, part + b * split * part_stride, part_stride, dt);
        }
        free(scr);
    }
    free(part);
    return failed ? 4 : 0;
}
