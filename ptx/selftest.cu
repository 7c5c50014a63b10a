// selftest.cu: tiny kernels that exercise every parameter kind, dynamic shared memory and the
// launch path. Used by the tests, `python -m hss info` (smoke launch) and `python -m hss.bench launch`.
//
// selftest_empty(a ptr, b ptr, n i32): does nothing (launch-overhead benchmark). Any geometry.
// selftest_fill_u32(out u32[n], value u32, n i32): out[i] = value. Any 1-D geometry (grid-stride).
// selftest_axpy(out f32[n], index_out i64[n], x f32[n], y f32[n], a f32, n i32, mul u32, add i64):
//     out[i] = fmaf(a, x[i], y[i]); index_out[i] = (i64)i * mul + add (wrapping). Any 1-D geometry.
// selftest_block_sum(x f32[n], out f32[ceil(n/B)], n i32): out[b] = sum of x[b*B .. b*B+B-1] (zeros
//     past n) by a shared-memory tree. Launch grid (ceil(n/B)), block (B) with B a power of two,
//     dynamic shared memory 4*B bytes.
#include "hss_common.cuh"

extern "C" __global__ void selftest_empty(const float* a, float* b, int n) {}

extern "C" __global__ void selftest_fill_u32(unsigned int* out, unsigned int value, int n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = value;
}

extern "C" __global__ void selftest_axpy(float* out, long long* index_out, const float* x, const float* y,
                                         float a, int n, unsigned int mul, long long add) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = fmaf(a, x[i], y[i]);
        index_out[i] = (long long)((unsigned long long)i * (unsigned long long)mul + (unsigned long long)add);
    }
}

extern "C" __global__ void selftest_block_sum(const float* x, float* out, int n) {
    extern __shared__ float buf[];
    const unsigned int t = threadIdx.x;
    const long long i = blockIdx.x * (long long)blockDim.x + t;
    buf[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (unsigned int half = blockDim.x / 2; half > 0; half >>= 1) {
        if (t < half) buf[t] += buf[t + half];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = buf[0];
}
