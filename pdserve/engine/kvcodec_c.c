/* The anchor/residual KV codec on CPU: split, join and dequantize-anchor over raw pointers.
 *
 * Writes the same bytes as the PyTorch reference in kvcodec.py (format version 1, see
 * docs/kvcodec.md); kvcodec_cpu.py compiles this file and calls it through ctypes. Plain C99, no
 * Python or torch headers. Values are read and written as unsigned integers (uint16 for bf16 and
 * fp16, uint32 for fp32), so no float operation touches them and NaN payloads survive.
 *
 * Layout (n = element count, G = 32, ngroups = ceil(n / G)):
 *   fp16:      anchor = n bytes (high byte), residual = n bytes (low byte)
 *   bf16/fp32: anchor = [ngroups header bytes][n value bytes], residual = 1 or 3 planes of n bytes
 * Every entry point takes a half-open range of groups [g0, g1) (fp16 too: 32 values a "group"),
 * so a caller can cut one tensor into chunks and run them from several threads; the chunks write
 * disjoint bytes. The tail group (n % 32 values) is padded with +0 like the reference does.
 *
 * Join of planes that no split wrote follows the reference's int32 arithmetic (wrapping shifts,
 * the result truncated to the value's width), so even garbage planes give the reference's bytes.
 */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define G 32
#define RAW 255u      /* header byte of a raw group */
#define MAXD 7u       /* deltas of 7 or more take their exponent from ext */
#define ZEXT 31u      /* ext code of e == 0 */
#define MAXGAP 37     /* the widest E - e (e > 0) a normal group codes */

#define KVC_ABI 1

/* On x86-64 Linux, build each hot loop twice (AVX2 and baseline SSE2) and let the loader pick by
 * CPU (an ifunc), so one cached library is fast and still runs on any x86-64. The per-group
 * functions are inlined into both. Elsewhere, without the attribute or with -DKVC_NO_CLONES, one
 * baseline build. */
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute) && !defined(KVC_NO_CLONES)
#if __has_attribute(target_clones)
#define KVC_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef KVC_CLONES
#define KVC_CLONES
#endif
#if defined(__GNUC__)
#define KVC_INLINE static inline __attribute__((always_inline))
#else
#define KVC_INLINE static inline
#endif

int kvc_abi(void) { return KVC_ABI; }

/* ---- bfloat16: W = 16, M = 7, R = 3, one residual plane ---------------------------------- */

KVC_INLINE void split_bf16_group(const uint16_t *restrict x, uint8_t *restrict hdr,
                             uint8_t *restrict a, uint8_t *restrict r)
{
    uint8_t e[G], enz[G];
    for (int i = 0; i < G; i++)
        e[i] = (uint8_t)(x[i] >> 7);
    for (int i = 0; i < G; i++)
        enz[i] = e[i] ? e[i] : 255;
    uint8_t emax = 0, emin = 255; /* emin: over nonzero exponents */
    for (int i = 0; i < G; i++)
        emax = e[i] > emax ? e[i] : emax;
    for (int i = 0; i < G; i++)
        emin = enz[i] < emin ? enz[i] : emin;
    if (emax == RAW || (int)emax - (int)emin > MAXGAP) {
        *hdr = RAW;
        for (int i = 0; i < G; i++) {
            a[i] = (uint8_t)(x[i] >> 8);
            r[i] = (uint8_t)x[i];
        }
        return;
    }
    *hdr = emax;
    for (int i = 0; i < G; i++) {
        uint16_t v = x[i];
        uint8_t d = (uint8_t)(emax - e[i]);
        uint8_t dc = d < MAXD ? d : MAXD;
        uint8_t ext = d < MAXD ? 0 : (e[i] == 0 ? ZEXT : (uint8_t)(d - MAXD));
        a[i] = (uint8_t)(((v >> 8) & 0x80) | (dc << 4) | ((v >> 3) & 0xF));
        r[i] = (uint8_t)((ext << 3) | (v & 7));
    }
}

KVC_INLINE void join_bf16_group(uint8_t h, const uint8_t *restrict a, const uint8_t *restrict r,
                            uint16_t *restrict out)
{
    if (h == RAW) {
        for (int i = 0; i < G; i++)
            out[i] = (uint16_t)((a[i] << 8) | r[i]);
        return;
    }
    for (int i = 0; i < G; i++) {
        uint16_t ai = a[i], ri = r[i];
        uint16_t ext = ri >> 3;
        uint16_t e = ext == ZEXT ? 0 : (uint16_t)(h - ((ai >> 4) & 7) - ext);
        out[i] = (uint16_t)(((ai & 0x80) << 8) | (e << 7) | ((ai & 0xF) << 3) | (ri & 7));
    }
}

KVC_INLINE void dequant_bf16_group(uint8_t h, const uint8_t *restrict a, uint16_t *restrict out)
{
    if (h == RAW) {
        for (int i = 0; i < G; i++) {
            uint16_t ai = a[i], hi7 = ai & 0x7F, sign = (uint16_t)((ai & 0x80) << 8);
            uint16_t mid = (uint16_t)((ai << 8) | (1u << 7));
            out[i] = hi7 == 0 ? sign : (hi7 == 0x7F ? (uint16_t)(sign | (0xFFu << 7)) : mid);
        }
        return;
    }
    for (int i = 0; i < G; i++) {
        uint16_t ai = a[i];
        uint16_t dc = (ai >> 4) & 7;
        int16_t e = (int16_t)(h - dc); /* -7 .. 254 */
        uint16_t sign = (uint16_t)((ai & 0x80) << 8);
        uint16_t ec = e > 0 ? (uint16_t)e : 0;
        uint16_t mid = e > 0 ? (1u << 2) : 0;
        uint16_t v = (uint16_t)(sign | (ec << 7) | ((ai & 0xF) << 3) | mid);
        out[i] = dc < MAXD ? v : sign;
    }
}

/* ---- float32: W = 32, M = 23, R = 19, three residual planes (low byte first) -------------- */

KVC_INLINE void split_f32_group(const uint32_t *restrict x, uint8_t *restrict hdr, uint8_t *restrict a,
                            uint8_t *restrict r0, uint8_t *restrict r1, uint8_t *restrict r2)
{
    uint8_t e[G], enz[G];
    for (int i = 0; i < G; i++)
        e[i] = (uint8_t)(x[i] >> 23);
    for (int i = 0; i < G; i++)
        enz[i] = e[i] ? e[i] : 255;
    uint8_t emax = 0, emin = 255; /* emin: over nonzero exponents */
    for (int i = 0; i < G; i++)
        emax = e[i] > emax ? e[i] : emax;
    for (int i = 0; i < G; i++)
        emin = enz[i] < emin ? enz[i] : emin;
    if (emax == RAW || (int)emax - (int)emin > MAXGAP) {
        *hdr = RAW;
        for (int i = 0; i < G; i++) {
            uint32_t v = x[i];
            a[i] = (uint8_t)(v >> 24);
            r0[i] = (uint8_t)v;
            r1[i] = (uint8_t)(v >> 8);
            r2[i] = (uint8_t)(v >> 16);
        }
        return;
    }
    *hdr = emax;
    for (int i = 0; i < G; i++) {
        uint32_t v = x[i];
        uint8_t d = (uint8_t)(emax - e[i]);
        uint8_t dc = d < MAXD ? d : MAXD;
        uint8_t ext = d < MAXD ? 0 : (e[i] == 0 ? ZEXT : (uint8_t)(d - MAXD));
        a[i] = (uint8_t)(((v >> 24) & 0x80) | ((uint32_t)dc << 4) | ((v >> 19) & 0xF));
        r0[i] = (uint8_t)v;
        r1[i] = (uint8_t)(v >> 8);
        r2[i] = (uint8_t)((ext << 3) | ((v >> 16) & 7)); /* bits 16..23 of ext << 19 | low 19 */
    }
}

KVC_INLINE void join_f32_group(uint8_t h, const uint8_t *restrict a, const uint8_t *restrict r0,
                           const uint8_t *restrict r1, const uint8_t *restrict r2,
                           uint32_t *restrict out)
{
    if (h == RAW) {
        for (int i = 0; i < G; i++)
            out[i] = ((uint32_t)a[i] << 24) | ((uint32_t)r2[i] << 16) | ((uint32_t)r1[i] << 8) | r0[i];
        return;
    }
    for (int i = 0; i < G; i++) {
        uint32_t ai = a[i];
        uint32_t ext = (uint32_t)r2[i] >> 3;
        uint32_t e = ext == ZEXT ? 0 : (uint32_t)h - ((ai >> 4) & 7) - ext;
        uint32_t low = ((uint32_t)(r2[i] & 7) << 16) | ((uint32_t)r1[i] << 8) | r0[i];
        out[i] = ((ai & 0x80) << 24) | (e << 23) | ((ai & 0xF) << 19) | low;
    }
}

KVC_INLINE void dequant_f32_group(uint8_t h, const uint8_t *restrict a, uint32_t *restrict out)
{
    if (h == RAW) {
        for (int i = 0; i < G; i++) {
            uint32_t ai = a[i], hi7 = ai & 0x7F, sign = (ai & 0x80) << 24;
            uint32_t mid = (ai << 24) | (1u << 23);
            out[i] = hi7 == 0 ? sign : (hi7 == 0x7F ? (sign | (0xFFu << 23)) : mid);
        }
        return;
    }
    for (int i = 0; i < G; i++) {
        int32_t ai = a[i];
        int32_t dc = (ai >> 4) & 7;
        int32_t e = (int32_t)h - dc;
        uint32_t sign = ((uint32_t)ai & 0x80) << 24;
        uint32_t ec = e > 0 ? (uint32_t)e : 0;
        uint32_t mid = e > 0 ? (1u << 18) : 0;
        uint32_t v = sign | (ec << 23) | ((uint32_t)(ai & 0xF) << 19) | mid;
        out[i] = dc < (int32_t)MAXD ? v : sign;
    }
}

/* ---- float16: elementwise, no groups ------------------------------------------------------ */

KVC_CLONES static void split_f16_run(const uint16_t *restrict x, uint8_t *restrict a, uint8_t *restrict r,
                          int64_t m)
{
    for (int64_t i = 0; i < m; i++) {
        a[i] = (uint8_t)(x[i] >> 8);
        r[i] = (uint8_t)x[i];
    }
}

KVC_CLONES static void join_f16_run(const uint8_t *restrict a, const uint8_t *restrict r,
                         uint16_t *restrict out, int64_t m)
{
    for (int64_t i = 0; i < m; i++)
        out[i] = (uint16_t)((a[i] << 8) | r[i]);
}

KVC_CLONES static void dequant_f16_run(const uint8_t *restrict a, uint16_t *restrict out, int64_t m)
{
    for (int64_t i = 0; i < m; i++) {
        uint16_t ai = a[i];
        uint16_t exp5 = (ai >> 2) & 0x1F;
        uint16_t mid = (exp5 > 0 && exp5 < 0x1F) ? 0x80 : 0;
        out[i] = (uint16_t)((ai << 8) | mid);
    }
}

/* ---- loops over whole groups: the hot paths (the tail group goes through them too, from a
 * zero-padded copy, so each loop is compiled once per target) ------------------------------- */

KVC_CLONES static void split_bf16_groups(const uint16_t *restrict x, uint8_t *restrict hdr,
                                         uint8_t *restrict a, uint8_t *restrict r, int64_t count)
{
    for (int64_t g = 0; g < count; g++)
        split_bf16_group(x + g * G, hdr + g, a + g * G, r + g * G);
}

KVC_CLONES static void split_f32_groups(const uint32_t *restrict x, uint8_t *restrict hdr,
                                        uint8_t *restrict a, uint8_t *restrict r0,
                                        uint8_t *restrict r1, uint8_t *restrict r2, int64_t count)
{
    for (int64_t g = 0; g < count; g++) {
        int64_t o = g * G;
        split_f32_group(x + o, hdr + g, a + o, r0 + o, r1 + o, r2 + o);
    }
}

KVC_CLONES static void join_bf16_groups(const uint8_t *restrict hdr, const uint8_t *restrict a,
                                        const uint8_t *restrict r, uint16_t *restrict out,
                                        int64_t count)
{
    for (int64_t g = 0; g < count; g++)
        join_bf16_group(hdr[g], a + g * G, r + g * G, out + g * G);
}

KVC_CLONES static void join_f32_groups(const uint8_t *restrict hdr, const uint8_t *restrict a,
                                       const uint8_t *restrict r0, const uint8_t *restrict r1,
                                       const uint8_t *restrict r2, uint32_t *restrict out,
                                       int64_t count)
{
    for (int64_t g = 0; g < count; g++) {
        int64_t o = g * G;
        join_f32_group(hdr[g], a + o, r0 + o, r1 + o, r2 + o, out + o);
    }
}

KVC_CLONES static void dequant_bf16_groups(const uint8_t *restrict hdr, const uint8_t *restrict a,
                                           uint16_t *restrict out, int64_t count)
{
    for (int64_t g = 0; g < count; g++)
        dequant_bf16_group(hdr[g], a + g * G, out + g * G);
}

KVC_CLONES static void dequant_f32_groups(const uint8_t *restrict hdr, const uint8_t *restrict a,
                                          uint32_t *restrict out, int64_t count)
{
    for (int64_t g = 0; g < count; g++)
        dequant_f32_group(hdr[g], a + g * G, out + g * G);
}

/* ---- entry points: dtype 1 = float32, 2 = bfloat16, 3 = float16 (CodecSpec's codes) ------- *
 * Each ends in (n, g0, g1): the groups [g0, g1) of a tensor of n values (clamped to the tensor;
 * fp16 counts 32 values a group too). The anchor and residual pointers are the whole planes
 * (offsets inside them are computed from n), whatever the range. Returns 0, or -1 for an unknown
 * dtype. */

static int64_t ngroups_of(int64_t n) { return (n + G - 1) / G; }

/* Clamp [g0, g1) to the tensor's groups and split off the tail: full groups [g0, *gf), and
 * *tail = 1 when the range holds the partial last group (whose index is n / G). 0: empty. */
static int range_of(int64_t n, int64_t *g0, int64_t g1, int64_t *gf, int *tail)
{
    int64_t ng = ngroups_of(n), full_end = n / G;
    if (*g0 < 0)
        *g0 = 0;
    if (g1 > ng)
        g1 = ng;
    if (n <= 0 || *g0 >= g1)
        return 0;
    *gf = g1 < full_end ? g1 : full_end;
    if (*gf < *g0)
        *gf = *g0;
    *tail = g1 > full_end;
    return 1;
}

int kvc_split(int dtype, const void *src, uint8_t *anchor, uint8_t *residual, int64_t n,
              int64_t g0, int64_t g1)
{
    int64_t gf;
    int tail;
    if (dtype < 1 || dtype > 3)
        return -1;
    if (!range_of(n, &g0, g1, &gf, &tail))
        return 0;
    int64_t ng = ngroups_of(n), base = n / G * G, m = n - base; /* the tail: m values at base */
    if (dtype == 3) {
        const uint16_t *x = (const uint16_t *)src;
        int64_t i0 = g0 * G, i1 = tail ? n : gf * G;
        split_f16_run(x + i0, anchor + i0, residual + i0, i1 - i0);
        return 0;
    }
    uint8_t *a = anchor + ng;
    if (dtype == 2) {
        const uint16_t *x = (const uint16_t *)src;
        split_bf16_groups(x + g0 * G, anchor + g0, a + g0 * G, residual + g0 * G, gf - g0);
        if (tail) {
            uint16_t xt[G] = {0};
            uint8_t at[G], rt[G];
            memcpy(xt, x + base, (size_t)m * sizeof *xt);
            split_bf16_groups(xt, anchor + n / G, at, rt, 1);
            memcpy(a + base, at, (size_t)m);
            memcpy(residual + base, rt, (size_t)m);
        }
        return 0;
    }
    const uint32_t *x = (const uint32_t *)src;
    uint8_t *r0 = residual, *r1 = residual + n, *r2 = residual + 2 * n;
    int64_t o = g0 * G;
    split_f32_groups(x + o, anchor + g0, a + o, r0 + o, r1 + o, r2 + o, gf - g0);
    if (tail) {
        uint32_t xt[G] = {0};
        uint8_t at[G], t0[G], t1[G], t2[G];
        memcpy(xt, x + base, (size_t)m * sizeof *xt);
        split_f32_groups(xt, anchor + n / G, at, t0, t1, t2, 1);
        memcpy(a + base, at, (size_t)m);
        memcpy(r0 + base, t0, (size_t)m);
        memcpy(r1 + base, t1, (size_t)m);
        memcpy(r2 + base, t2, (size_t)m);
    }
    return 0;
}

int kvc_join(int dtype, const uint8_t *anchor, const uint8_t *residual, void *dst, int64_t n,
             int64_t g0, int64_t g1)
{
    int64_t gf;
    int tail;
    if (dtype < 1 || dtype > 3)
        return -1;
    if (!range_of(n, &g0, g1, &gf, &tail))
        return 0;
    int64_t ng = ngroups_of(n), base = n / G * G, m = n - base;
    if (dtype == 3) {
        uint16_t *out = (uint16_t *)dst;
        int64_t i0 = g0 * G, i1 = tail ? n : gf * G;
        join_f16_run(anchor + i0, residual + i0, out + i0, i1 - i0);
        return 0;
    }
    const uint8_t *a = anchor + ng;
    if (dtype == 2) {
        uint16_t *out = (uint16_t *)dst;
        join_bf16_groups(anchor + g0, a + g0 * G, residual + g0 * G, out + g0 * G, gf - g0);
        if (tail) {
            uint8_t at[G] = {0}, rt[G] = {0};
            uint16_t ot[G];
            memcpy(at, a + base, (size_t)m);
            memcpy(rt, residual + base, (size_t)m);
            join_bf16_groups(anchor + n / G, at, rt, ot, 1);
            memcpy(out + base, ot, (size_t)m * sizeof *ot);
        }
        return 0;
    }
    uint32_t *out = (uint32_t *)dst;
    const uint8_t *r0 = residual, *r1 = residual + n, *r2 = residual + 2 * n;
    int64_t o = g0 * G;
    join_f32_groups(anchor + g0, a + o, r0 + o, r1 + o, r2 + o, out + o, gf - g0);
    if (tail) {
        uint8_t at[G] = {0}, t0[G] = {0}, t1[G] = {0}, t2[G] = {0};
        uint32_t ot[G];
        memcpy(at, a + base, (size_t)m);
        memcpy(t0, r0 + base, (size_t)m);
        memcpy(t1, r1 + base, (size_t)m);
        memcpy(t2, r2 + base, (size_t)m);
        join_f32_groups(anchor + n / G, at, t0, t1, t2, ot, 1);
        memcpy(out + base, ot, (size_t)m * sizeof *ot);
    }
    return 0;
}

int kvc_dequantize(int dtype, const uint8_t *anchor, void *dst, int64_t n, int64_t g0, int64_t g1)
{
    int64_t gf;
    int tail;
    if (dtype < 1 || dtype > 3)
        return -1;
    if (!range_of(n, &g0, g1, &gf, &tail))
        return 0;
    int64_t ng = ngroups_of(n), base = n / G * G, m = n - base;
    if (dtype == 3) {
        uint16_t *out = (uint16_t *)dst;
        int64_t i0 = g0 * G, i1 = tail ? n : gf * G;
        dequant_f16_run(anchor + i0, out + i0, i1 - i0);
        return 0;
    }
    const uint8_t *a = anchor + ng;
    uint8_t at[G] = {0};
    if (tail)
        memcpy(at, a + base, (size_t)m);
    if (dtype == 2) {
        uint16_t *out = (uint16_t *)dst, ot[G];
        dequant_bf16_groups(anchor + g0, a + g0 * G, out + g0 * G, gf - g0);
        if (tail) {
            dequant_bf16_groups(anchor + n / G, at, ot, 1);
            memcpy(out + base, ot, (size_t)m * sizeof *ot);
        }
        return 0;
    }
    uint32_t *out = (uint32_t *)dst, ot[G];
    dequant_f32_groups(anchor + g0, a + g0 * G, out + g0 * G, gf - g0);
    if (tail) {
        dequant_f32_groups(anchor + n / G, at, ot, 1);
        memcpy(out + base, ot, (size_t)m * sizeof *ot);
    }
    return 0;
}
