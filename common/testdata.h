/* testdata.h - seeded, deterministic data for dispatch and combine: the inputs of the tests, of
 * epd-bench and of epd-demo (library epd_datagen).
 *
 * Everything is a function of a 64-bit seed (xoshiro256** seeded through splitmix64), so a failing
 * case can be replayed from the seed its run printed. Generators write into caller-owned strided
 * buffers and never allocate.
 */
#ifndef EPD_COMMON_TESTDATA_H
#define EPD_COMMON_TESTDATA_H

#include <stddef.h>
#include <stdint.h>

#include "epd.h"

struct td_rng {
        uint64_t s[4];
};

/* Seeds the generator; the same seed gives the same stream on every platform. */
void td_rng_seed(struct td_rng *rng, uint64_t seed);
uint64_t td_rng_next(struct td_rng *rng);
/* Uniform in [0, n); n >= 1. */
uint32_t td_rng_below(struct td_rng *rng, uint32_t n);
/* Uniform in [0, 1) with 53 random bits. */
double td_rng_unit(struct td_rng *rng);
/* A seed derived from a base seed and a case index, for per-case seeds in table-driven tests. */
uint64_t td_mix_seed(uint64_t base, uint64_t index);

enum td_routing {
        TD_ROUTING_UNIFORM = 0,  /* top-k without repeats, uniform over E */
        TD_ROUTING_SKEWED = 1,   /* hot_rank receives about twice the average selections */
        TD_ROUTING_ONE_RANK = 2, /* every selection on hot_rank (-1 beyond its L experts) */
};

struct td_routing_args {
        uint32_t world_size;
        uint32_t num_experts;
        uint32_t num_tokens;     /* rows to write */
        uint32_t num_topk;       /* K_op */
        enum td_routing mode;
        uint32_t hot_rank;       /* SKEWED / ONE_RANK */
        double minus_one_prob;   /* each entry independently becomes -1 with this probability */
        double empty_row_prob;   /* a whole row becomes -1 with this probability */
        enum epd_dtype dtype;    /* EPD_DTYPE_INT32 or EPD_DTYPE_INT64 */
        uint64_t row_stride;     /* in elements; 0 means num_topk */
};

/* Writes num_tokens rows of valid topk_idx: distinct experts per row, -1 anywhere. When a row
 * cannot hold K distinct experts (K > E, or ONE_RANK with K > L), the rest of the row is -1.
 * Positions of the experts within a row are random. */
void td_gen_topk(struct td_rng *rng, const struct td_routing_args *args, void *out);

/* Random bf16 [rows, cols] at out with row stride stride_bytes (0: packed). Values are finite
 * normals in about [-8, 8] with random mantissas; with probability special_prob an element is
 * instead one of +-0, +-inf, NaN (several payloads), a subnormal or a huge value. */
void td_fill_bf16(struct td_rng *rng, void *out, uint64_t rows, uint64_t cols,
                  uint64_t stride_bytes, double special_prob);
/* Uniformly random bytes (every fp8 e4m3 pattern, NaNs included: dispatch copies bits). */
void td_fill_bytes(struct td_rng *rng, void *out, uint64_t rows, uint64_t row_bytes,
                   uint64_t stride_bytes);
/* fp32 [rows, cols] uniform in [lo, hi). */
void td_fill_f32(struct td_rng *rng, void *out, uint64_t rows, uint64_t cols,
                 uint64_t stride_bytes, float lo, float hi);
/* Fills every byte of [rows, row_bytes] (stride 0: packed) with a value; for poisoning outputs. */
void td_fill_pattern(void *out, uint64_t rows, uint64_t row_bytes, uint64_t stride_bytes,
                     uint8_t value);

#endif
