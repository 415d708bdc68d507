/* The batched verdict's scan of sampled positions in one compiled pass per position (cloud_verifier/verdict/
 * scan_native.py (next to it) loads it; cloud_verifier/verdict/scan_numpy.py is the same computation in numpy and
 * the contract of both is cloud_verifier/verdict/scan.py's Scan).
 *
 * Per position: the max logit (NaN propagates), then one pass in cache that counts the tokens at or above
 * max - BOUND_GAP*T and gathers those at or above max - EXACT_GAP*T (a few hundred of 49,152 on real LM logits),
 * then, over the gathered tokens only: the float64 softmax normaliser with its bounds for the rest, and the
 * candidates by quarter-unit buckets of the scaled gap to the max. The arithmetic is numpy backend's, operation
 * for operation, so both give the same numbers up to the last ulp of exp (glibc's vs numpy's; the bounds carry
 * a 1e-10 margin). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef struct {
    float v;
    int64_t id;
} token_t;

static float chunk_max(const float *x, int64_t n, int *nan) {
    int64_t i = 0;
    float mx = -INFINITY;
#if defined(__AVX512F__)
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
    __mmask16 n0 = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        m0 = _mm512_max_ps(m0, a);
        m1 = _mm512_max_ps(m1, b);
        n0 |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    }
    mx = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
    *nan |= n0 != 0;
#elif defined(__AVX2__)
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    __m256 n0 = _mm256_setzero_ps(), n1 = n0;
    for (; i + 32 <= n; i += 32) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
        m0 = _mm256_max_ps(m0, a);
        m1 = _mm256_max_ps(m1, b);
        m2 = _mm256_max_ps(m2, c);
        m3 = _mm256_max_ps(m3, d);
        n0 = _mm256_or_ps(n0, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
        n1 = _mm256_or_ps(n1, _mm256_or_ps(_mm256_cmp_ps(c, c, _CMP_UNORD_Q), _mm256_cmp_ps(d, d, _CMP_UNORD_Q)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (int j = 0; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
    *nan |= _mm256_movemask_ps(_mm256_or_ps(n0, n1)) != 0;
#endif
    for (; i < n; i++) {
        float v = x[i];
        *nan |= v != v;
        mx = v > mx ? v : mx;
    }
    return mx;
}

/* Appends the tokens of x whose bits are set in hit (ids first + bit) to out[k..]; returns the new k. */
static inline int64_t append_hits(const float *x, int64_t first, unsigned hit, token_t *out, int64_t k) {
    while (hit) {
        int j = __builtin_ctz(hit);
        out[k].v = x[j];
        out[k].id = first + j;
        k++;
        hit &= hit - 1;
    }
    return k;
}

/* Counts the tokens of x[0:n] at or above thr_bound and appends those at or above thr_exact (>= thr_bound; ids
 * first + j) to out[k..]; returns the new k. The count is branch-free; the gather branches once per 16 tokens
 * on whether any is that close to the max (a few hundred of 49,152 on real logits). */
static int64_t count_and_gather(const float *x, int64_t n, int64_t first, float thr_exact, float thr_bound,
                                token_t *out, int64_t k, int64_t *within_bound) {
    int64_t i = 0, count = 0;
#if defined(__AVX512F__)
    __m512 tb = _mm512_set1_ps(thr_bound), te = _mm512_set1_ps(thr_exact);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        count += __builtin_popcount(_mm512_cmp_ps_mask(v, tb, _CMP_GE_OQ));
        unsigned hit = _mm512_cmp_ps_mask(v, te, _CMP_GE_OQ);
        k = append_hits(x + i, first + i, hit, out, k);
    }
#elif defined(__AVX2__)
    __m256 tb = _mm256_set1_ps(thr_bound), te = _mm256_set1_ps(thr_exact);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        count += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(v, tb, _CMP_GE_OQ)));
        unsigned hit = _mm256_movemask_ps(_mm256_cmp_ps(v, te, _CMP_GE_OQ));
        k = append_hits(x + i, first + i, hit, out, k);
    }
#endif
    for (; i < n; i++) {
        float v = x[i];
        count += v >= thr_bound;
        if (v >= thr_exact) {
            out[k].v = v;
            out[k].id = first + i;
            k++;
        }
    }
    *within_bound += count;
    return k;
}

#define SPAN 512 /* tokens per span: the second pass skips a span whose max is below the bound's threshold */

/* One position: its max logit (NaN if any logit is NaN; one pass from memory, each span's max kept), then the
 * spans that hold a token at or above max - BOUND_GAP*T again (in cache): counted there, and those at or above
 * max - EXACT_GAP*T gathered in ascending id. Returns how many were gathered. */
static int64_t scan_position(const float *x, int64_t vocab, double t, double exact_gap, double bound_gap,
                             float *span_max, token_t *out, float *max_out, float *thr_exact, float *thr_bound,
                             int64_t *within_bound) {
    int nan = 0;
    float mx = -INFINITY;
    int64_t spans = (vocab + SPAN - 1) / SPAN, k = 0;
    for (int64_t s = 0; s < spans; s++) {
        int64_t lo = s * SPAN, n = vocab - lo < SPAN ? vocab - lo : SPAN;
        span_max[s] = chunk_max(x + lo, n, &nan);
        mx = span_max[s] > mx ? span_max[s] : mx;
    }
    if (nan) mx = NAN;
    double m64 = (double)mx;
    float te = (float)(m64 - exact_gap * t), tb = (float)(m64 - bound_gap * t);
    *max_out = mx, *thr_exact = te, *thr_bound = tb, *within_bound = 0;
    for (int64_t s = 0; s < spans && !nan; s++) {
        if (!(span_max[s] >= tb)) continue;
        int64_t lo = s * SPAN, n = vocab - lo < SPAN ? vocab - lo : SPAN;
        k = count_and_gather(x + lo, n, lo, te, tb, out, k, within_bound);
    }
    return k;
}

static int by_value_desc(const void *a, const void *b) {  /* stable on ids: ties in ascending id */
    const token_t *x = a, *y = b;
    if (x->v != y->v) return x->v > y->v ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The candidates of one position from its g gathered tokens (numpy backend's _candidates). */
static void candidates(token_t *tok, int64_t g, double m64, double t, int64_t c, int64_t buckets_per_unit,
                       int64_t nb, int64_t *bucket, int64_t *hist, float thr_exact, float *cand, int64_t *cand_ids,
                       float *outside) {
    for (int64_t j = 0; j < c; j++) {
        cand[j] = -INFINITY;
        cand_ids[j] = -1;
    }
    memset(hist, 0, sizeof(int64_t) * nb);
    for (int64_t a = 0; a < g; a++) {
        double gap = (m64 - (double)tok[a].v) / t * (double)buckets_per_unit;
        int64_t b = nb - 1;
        if (isfinite(gap)) b = gap < 0 ? 0 : (gap > (double)(nb - 1) ? nb - 1 : (int64_t)gap);
        bucket[a] = b;
        hist[b]++;
    }
    int64_t crossing = nb, total = 0;
    for (int64_t b = 0; b < nb; b++) {
        total += hist[b];
        if (total > c) {
            crossing = b;
            break;
        }
    }
    if (crossing == 0 && g > 0) {  /* the max's own bucket holds more than c: the c largest, exactly */
        qsort(tok, (size_t)g, sizeof(token_t), by_value_desc);
        for (int64_t j = 0; j < c; j++) {
            cand[j] = tok[j].v;
            cand_ids[j] = tok[j].id;
        }
        *outside = tok[c].v;
        return;
    }
    float out = -INFINITY;
    int64_t taken = 0;
    for (int64_t a = 0; a < g; a++) {
        if (bucket[a] < crossing) {
            tok[taken++] = tok[a];  /* in place: taken <= a */
        } else if (tok[a].v > out || out != out) {
            out = tok[a].v;
        }
    }
    qsort(tok, (size_t)taken, sizeof(token_t), by_value_desc);
    for (int64_t j = 0; j < taken; j++) {
        cand[j] = tok[j].v;
        cand_ids[j] = tok[j].id;
    }
    *outside = g <= c ? thr_exact : out;
}

/* n sampled positions: xs[i] points at position i's vocab float32 logits, t[i] its temperature (> 0). Writes
 * m[i], cand_logits[i*c..], cand_ids[i*c..], z_low[i], z_high[i], outside[i]. Returns 0, or -1 when out of
 * memory. */
int scan_sampled(int64_t n, const uint64_t *xs, int64_t vocab, const double *t, int64_t c, double exact_gap,
                 double bound_gap, int64_t buckets_per_unit, float *m, float *cand_logits, int64_t *cand_ids,
                 double *z_low, double *z_high, float *outside) {
    int64_t nb = (int64_t)(exact_gap * (double)buckets_per_unit) + 2;
    float *span_max = malloc(sizeof(float) * (size_t)(vocab / SPAN + 1));
    token_t *tok = malloc(sizeof(token_t) * (size_t)vocab);
    int64_t *bucket = malloc(sizeof(int64_t) * (size_t)vocab);
    int64_t *hist = malloc(sizeof(int64_t) * (size_t)nb);
    int status = span_max && tok && bucket && hist ? 0 : -1;
    for (int64_t i = 0; i < n && status == 0; i++) {
        float mx, thr_e, thr_b;
        int64_t within;
        double ti = t[i];
        int64_t g = scan_position((const float *)(uintptr_t)xs[i], vocab, ti, exact_gap, bound_gap, span_max, tok,
                                  &mx, &thr_e, &thr_b, &within);
        double m64 = (double)mx, z_in = 0.0;
        for (int64_t a = 0; a < g; a++) z_in += exp((double)tok[a].v / ti - m64 / ti);  /* numpy's terms, id order */
        double tail = (double)(within - g) * exp(((double)thr_e - m64) / ti)
                      + (double)(vocab - within) * exp(((double)thr_b - m64) / ti);
        m[i] = mx;
        z_low[i] = z_in * (1 - 1e-10);
        z_high[i] = (z_in + tail) * (1 + 1e-10);
        candidates(tok, g, m64, ti, c, buckets_per_unit, nb, bucket, hist, thr_e, cand_logits + i * c,
                   cand_ids + i * c, outside + i);
    }
    free(span_max);
    free(tok);
    free(bucket);
    free(hist);
    return status;
}

/* n greedy positions: argmax[i] and max_value[i] = xs[i][argmax[i]] as numpy's argmax: the first NaN if there
 * is one, else the lowest id among the ties at the max. */
void argmax_greedy(int64_t n, const uint64_t *xs, int64_t vocab, int64_t *argmax, float *max_value) {
    for (int64_t i = 0; i < n; i++) {
        const float *x = (const float *)(uintptr_t)xs[i];
        int nan = 0;
        float mx = chunk_max(x, vocab, &nan);
        int64_t j = 0;
        if (nan) {
            while (x[j] == x[j]) j++;
        } else {
            while (j < vocab - 1 && x[j] != mx) j++;
        }
        argmax[i] = j;
        max_value[i] = x[j];
    }
}
