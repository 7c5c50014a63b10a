// hss_mma.cuh: bf16 tensor-core mma.sync (sm_80+), f32 accumulate in place. Fragments as in the PTX ISA: with
// g = lane/4, c = lane%4, each 32-bit register holds two bf16 (lower k / column index in the low half).
#pragma once
#include <stdint.h>

// D += A (16x16 bf16, row) * B (16x8 bf16, col): a[0] = A[g][2c..2c+1], a[1] = A[g+8][2c..], a[2] = A[g][2c+8..],
// a[3] = A[g+8][2c+8..]; b0 = B[2c..2c+1][g], b1 = B[2c+8..2c+9][g]; d[0..1] = D[g][2c..2c+1], d[2..3] = D[g+8][..].
__device__ __forceinline__ void hss_mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D += A (16x8 bf16, row) * B (8x8 bf16, col): a0 = A[g][2c..2c+1], a1 = A[g+8][2c..2c+1], b = B[2c..2c+1][g].
__device__ __forceinline__ void hss_mma1688(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b));
}

// ldmatrix (sm_75+): four 8x8 b16 matrices from shared memory; lanes 8i .. 8i + 7 give the row addresses of matrix
// i (16-byte aligned), and register i of lane l receives matrix i's row l / 4, elements 2(l % 4) .. +1 (.trans: its
// column l / 4, rows 2(l % 4) .. +1).
__device__ __forceinline__ void hss_ldsm_x4(uint32_t (&r)[4], const void* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

__device__ __forceinline__ void hss_ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

__device__ __forceinline__ void hss_ldsm_x2_trans(uint32_t& r0, uint32_t& r1, const void* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(s));
}
