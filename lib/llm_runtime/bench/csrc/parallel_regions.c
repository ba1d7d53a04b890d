/*
 * What synchronising the threads costs between the stages of a step (lesson 19), measured two ways:
 *
 *   stages_as_regions:    each stage its own `#pragma omp parallel for`, as an operator-by-operator step runs
 *                         its C kernels: the pool's threads start the region, share out the items, and the
 *                         caller waits for the slowest before the region ends;
 *   stages_in_one_region: the threads enter one `#pragma omp parallel` and each stage is an `omp for` inside
 *                         it, as native_step.c runs a step: the only synchronisation is the barrier at the end
 *                         of each `omp for`.
 *
 * Each stage's items do `work` dependent multiply-adds on a register (no memory traffic), so with `work` = 0 the
 * time is the synchronisation alone. Both return seconds for `stages` stages (omp_get_wtime).
 */
#include <omp.h>
#include <stdint.h>

static volatile float sink; /* keeps the compiler from removing the items' arithmetic */

static inline float item(int64_t i, int64_t work) {
    float x = (float)i;
    for (int64_t k = 0; k < work; k++) x = x * 0.999f + 1.0f;
    return x;
}

double stages_as_regions(int64_t stages, int64_t items, int64_t work) {
    double start = omp_get_wtime();
    for (int64_t s = 0; s < stages; s++) {
        #pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < items; i++) {
            float x = item(i, work);
            if (x < 0.0f) sink = x; /* never true: the result is used, nothing is written */
        }
    }
    return omp_get_wtime() - start;
}

double stages_in_one_region(int64_t stages, int64_t items, int64_t work) {
    double start = omp_get_wtime();
    #pragma omp parallel
    for (int64_t s = 0; s < stages; s++) {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < items; i++) {
            float x = item(i, work);
            if (x < 0.0f) sink = x;
        }
    }
    return omp_get_wtime() - start;
}
