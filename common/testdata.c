/* testdata.c - seeded generators for routing and payloads (see testdata.h). */
#include <string.h>

#include "testdata.h"

/* ---- PRNG: splitmix64 to seed, xoshiro256** to generate ---- */

static uint64_t splitmix64(uint64_t *state)
{
        uint64_t z = (*state += 0x9E3779B97F4A7C15ull);

        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
        return (x << k) | (x >> (64 - k));
}

void td_rng_seed(struct td_rng *rng, uint64_t seed)
{
        uint64_t state = seed;

        for (int i = 0; i < 4; i++)
                rng->s[i] = splitmix64(&state);
}

uint64_t td_rng_next(struct td_rng *rng)
{
        uint64_t *s = rng->s;
        uint64_t result = rotl(s[1] * 5, 7) * 9;
        uint64_t t = s[1] << 17;

        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = rotl(s[3], 45);
        return result;
}

uint32_t td_rng_below(struct td_rng *rng, uint32_t n)
{
        /* Multiply-shift: the bias is below 2^-32, irrelevant for test data. */
        return (uint32_t)(((td_rng_next(rng) >> 32) * (uint64_t)n) >> 32);
}

double td_rng_unit(struct td_rng *rng)
{
        return (double)(td_rng_next(rng) >> 11) * (1.0 / 9007199254740992.0);
}

uint64_t td_mix_seed(uint64_t base, uint64_t index)
{
        uint64_t state = base ^ (index * 0xD1B54A32D192ED03ull);

        return splitmix64(&state);
}

/* ---- routing ---- */

static int contains(const int32_t *row, uint32_t n, int32_t e)
{
        for (uint32_t i = 0; i < n; i++)
                if (row[i] == e)
                        return 1;
        return 0;
}

/* Picks an expert not yet in chosen[0..n): first by rejection from the mode's distribution, then,
 * if that keeps hitting taken experts, uniformly among the free ones of the allowed range.
 * Returns -1 when no allowed expert is left. */
static int32_t pick_expert(struct td_rng *rng, const struct td_routing_args *a,
                           const int32_t *chosen, uint32_t n)
{
        const uint32_t E = a->num_experts, R = a->world_size, L = E / R;
        uint32_t lo = 0, hi = E;
        uint32_t free_count = 0;

        if (a->mode == TD_ROUTING_ONE_RANK) {
                lo = a->hot_rank * L;
                hi = lo + L;
        }
        for (int attempt = 0; attempt < 64; attempt++) {
                int32_t e;

                if (a->mode == TD_ROUTING_SKEWED && R > 1) {
                        /* The hot rank gets 2/R of the selections (twice its fair share); with
                         * two ranks that would be everything, so it gets 3/4 instead. */
                        double hot_share = R > 2 ? 2.0 / R : 0.75;
                        uint32_t rank;

                        if (td_rng_unit(rng) < hot_share) {
                                rank = a->hot_rank;
                        } else {
                                rank = td_rng_below(rng, R - 1);
                                if (rank >= a->hot_rank)
                                        rank++;
                        }
                        e = (int32_t)(rank * L + td_rng_below(rng, L));
                } else {
                        e = (int32_t)(lo + td_rng_below(rng, hi - lo));
                }
                if (!contains(chosen, n, e))
                        return e;
        }
        for (uint32_t e = lo; e < hi; e++)
                free_count += !contains(chosen, n, (int32_t)e);
        if (free_count == 0)
                return -1;
        free_count = td_rng_below(rng, free_count);
        for (uint32_t e = lo; e < hi; e++) {
                if (contains(chosen, n, (int32_t)e))
                        continue;
                if (free_count-- == 0)
                        return (int32_t)e;
        }
        return -1;
}

void td_gen_topk(struct td_rng *rng, const struct td_routing_args *a, void *out)
{
        const uint32_t K = a->num_topk;
        const uint64_t stride = a->row_stride ? a->row_stride : K;
        const size_t esz = a->dtype == EPD_DTYPE_INT64 ? 8 : 4;

        for (uint32_t t = 0; t < a->num_tokens; t++) {
                int32_t chosen[64];
                int32_t row[64];
                uint32_t n = 0;
                int empty = a->empty_row_prob > 0 && td_rng_unit(rng) < a->empty_row_prob;

                for (uint32_t k = 0; k < K; k++) {
                        int32_t e = pick_expert(rng, a, chosen, n);
                        if (e >= 0)
                                chosen[n++] = e;
                }
                /* Place the chosen experts at random positions, -1 elsewhere. */
                for (uint32_t k = 0; k < K; k++)
                        row[k] = k < n ? chosen[k] : -1;
                for (uint32_t k = K; k > 1; k--) {
                        uint32_t j = td_rng_below(rng, k);
                        int32_t tmp = row[k - 1];
                        row[k - 1] = row[j];
                        row[j] = tmp;
                }
                for (uint32_t k = 0; k < K; k++) {
                        int drop = a->minus_one_prob > 0 &&
                                   td_rng_unit(rng) < a->minus_one_prob;
                        if (empty || drop)
                                row[k] = -1;
                }
                for (uint32_t k = 0; k < K; k++) {
                        uint8_t *dst = (uint8_t *)out + ((uint64_t)t * stride + k) * esz;
                        if (esz == 8) {
                                int64_t v = row[k];
                                memcpy(dst, &v, 8);
                        } else {
                                memcpy(dst, &row[k], 4);
                        }
                }
        }
}

/* ---- payloads ---- */

static uint16_t special_bf16(struct td_rng *rng)
{
        static const uint16_t specials[] = {
                0x0000, 0x8000,         /* +0, -0 */
                0x7F80, 0xFF80,         /* +inf, -inf */
                0x7FC0, 0xFFC0, 0x7F81, /* quiet NaNs and a signalling NaN */
                0x0001, 0x8040, 0x007F, /* subnormals */
                0x7F7F, 0xFF7F,         /* largest finite: sums overflow to inf */
        };
        return specials[td_rng_below(rng, sizeof(specials) / sizeof(specials[0]))];
}

void td_fill_bf16(struct td_rng *rng, void *out, uint64_t rows, uint64_t cols,
                  uint64_t stride_bytes, double special_prob)
{
        uint64_t stride = stride_bytes ? stride_bytes : cols * 2;

        for (uint64_t r = 0; r < rows; r++) {
                uint8_t *row = (uint8_t *)out + r * stride;

                for (uint64_t c = 0; c < cols; c++) {
                        uint16_t v;

                        if (special_prob > 0 && td_rng_unit(rng) < special_prob) {
                                v = special_bf16(rng);
                        } else {
                                uint64_t bits = td_rng_next(rng);
                                /* Exponents 118..130 (about 2^-9 .. 2^3) with all 7 mantissa
                                 * bits random, so sums need rounding. */
                                uint16_t sign = (uint16_t)(bits & 1) << 15;
                                uint16_t exp = (uint16_t)(118 + (bits >> 8) % 13);
                                uint16_t mant = (uint16_t)((bits >> 16) & 0x7F);
                                v = (uint16_t)(sign | exp << 7 | mant);
                        }
                        memcpy(row + c * 2, &v, 2);
                }
        }
}

void td_fill_bytes(struct td_rng *rng, void *out, uint64_t rows, uint64_t row_bytes,
                   uint64_t stride_bytes)
{
        uint64_t stride = stride_bytes ? stride_bytes : row_bytes;

        for (uint64_t r = 0; r < rows; r++) {
                uint8_t *row = (uint8_t *)out + r * stride;
                uint64_t b = 0;

                for (; b + 8 <= row_bytes; b += 8) {
                        uint64_t v = td_rng_next(rng);
                        memcpy(row + b, &v, 8);
                }
                if (b < row_bytes) {
                        uint64_t v = td_rng_next(rng);
                        memcpy(row + b, &v, row_bytes - b);
                }
        }
}

void td_fill_f32(struct td_rng *rng, void *out, uint64_t rows, uint64_t cols,
                 uint64_t stride_bytes, float lo, float hi)
{
        uint64_t stride = stride_bytes ? stride_bytes : cols * 4;

        for (uint64_t r = 0; r < rows; r++) {
                uint8_t *row = (uint8_t *)out + r * stride;

                for (uint64_t c = 0; c < cols; c++) {
                        float v = lo + (float)td_rng_unit(rng) * (hi - lo);
                        memcpy(row + c * 4, &v, 4);
                }
        }
}

void td_fill_pattern(void *out, uint64_t rows, uint64_t row_bytes, uint64_t stride_bytes,
                     uint8_t value)
{
        uint64_t stride = stride_bytes ? stride_bytes : row_bytes;

        for (uint64_t r = 0; r < rows; r++)
                memset((uint8_t *)out + r * stride, value, row_bytes);
}
