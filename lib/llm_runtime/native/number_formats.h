/*
 * Numbers by their bits, shared by the package's C kernels (attention/csrc, model/csrc; found on the include path native/build.py gives): bfloat16 and
 * float16 to float32 and back, without any compiler extension type, so every C compiler builds them.
 *
 * float32 is 1 sign bit, 8 exponent bits (bias 127) and 23 mantissa bits: value = 2^(e - 127) * 1.m.
 * The narrower formats have the same shape with fewer bits, so converting a normal number moves its
 * exponent to float's bias and its mantissa to float's top mantissa bits.
 */
#ifndef LLM_RUNTIME_NUMBER_FORMATS_H
#define LLM_RUNTIME_NUMBER_FORMATS_H
#include <stdint.h>

static inline float bf16_to_float(uint16_t x) {  /* bfloat16 is the top half of a float */
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as PyTorch does */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN stays NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

/* float16: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits; exponent 0 is subnormal,
 * m * 2^-24, 31 infinity or NaN. The int8 KV pool's scales and the int4 weights' scales and offsets. */
static inline float fp16_to_float(uint16_t x) {
    const uint32_t sign = (uint32_t)(x & 0x8000u) << 16, exponent = (x >> 10) & 0x1fu, mantissa = x & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exponent == 0) v.f = (float)mantissa * 0x1p-24f;
    else if (exponent == 31) v.u = 0x7f800000u | mantissa << 13;
    else v.u = (exponent + 127 - 15) << 23 | mantissa << 13;
    v.u |= sign;
    return v.f;
}

#endif
