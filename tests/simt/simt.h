// simt.h: CUDA kernel source compiled by g++ and run on the CPU, one CTA at a time, each thread a cooperative fiber
// of one OS thread (tests/simt/__init__.py compiles a kernel file with it and launches it from numpy).
//
// What it models:
// - __syncthreads (and _or / _and / _count): every live thread of the CTA waits, at the same call site (else an
//   error: a barrier in divergent code); a thread that returned drops out of later barriers.
// - warp calls with a full mask (__shfl*_sync of any type of at most 8 bytes, with width; __ballot_sync,
//   __any_sync, __all_sync, __match_any_sync, __reduce_*_sync, __syncwarp): a barrier over the warp's 32 lanes,
//   every one live and at the same call site, else an error naming the lanes (a partial warp, a lane at
//   __syncthreads). Values go through a per-warp slot array; the last lane to arrive computes every lane's result
//   into the lanes' own words, so the slots are free again before any lane can reach the next call.
// - __shared__: static storage (a section the runtime finds), filled with a poison byte before every CTA; extern
//   __shared__: a per-launch buffer of the launch's dynamic size, poisoned too, ending at a guard page.
// - atomics: plain read-modify-writes. Threads switch only at barriers and warp calls, so a race is never seen
//   as torn data; it shows only as a result that changes with the schedule (the order threads run in between
//   waits: thread by thread ascending or descending, warp by warp, or seeded random; see sweep below), which tests
//   compare. compute-sanitizer's racecheck on the device is the real check.
// - threadIdx / blockIdx / blockDim / gridDim, the vector types, bf16 (cuda_bf16.h's names, round to nearest
//   even) and the integer and conversion intrinsics, bit for bit; invalid accesses, integer division by zero and
//   stack overflow (64 KiB a thread) reported as launch errors instead of signals.
// f32 / f64 arithmetic is the host's IEEE arithmetic (compiled with -ffp-contract=off, no fast math): + - * /
// sqrtf fmaf match the GPU's exactly; expf / exp2f / logf / sinf / rsqrtf and the other libm functions are
// glibc's (within 1 ulp), not CUDA's (expf within 2 ulp, rsqrtf within 2 ulp, __expf and the other fast
// intrinsics far coarser), so results at their rounding may differ from a GPU's. Inline PTX is rewritten by the
// Python side: known hints become no-ops, %dynamic_smem_size a call here, hss's ldmatrix (.x1/.x2/.x4, .trans),
// mma.sync m16n8k16 / m16n8k8 bf16 -> f32 and cp.async (done at once; commit and wait no-ops) warp calls and copies
// here (the mma sums in double and rounds once: not a GPU's bits), the .ftz f32 add / sub / mul / ex2.approx of
// hss_headscore.cuh calls here, anything else an error when reached.
// Not modelled: masks other than the full warp, clusters, cooperative groups, textures, printf ordering.
#pragma once

#include <math.h>
#include <signal.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(__x86_64__) || defined(SIMT_UCONTEXT)
#include <ucontext.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <utility>

using std::isinf;
using std::isnan;

// ---- keywords -----------------------------------------------------------------------------------------------
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __constant__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ __attribute__((section("simt_shared"))) static
#define __CUDACC__SIMT 1

// ---- vector types -------------------------------------------------------------------------------------------
#define SIMT_VEC2(T, N, A) struct __align__(A) N##2 { T x, y; }; \
    inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }
#define SIMT_VEC3(T, N) struct N##3 { T x, y, z; }; \
    inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }
#define SIMT_VEC4(T, N, A) struct __align__(A) N##4 { T x, y, z, w; }; \
    inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }
#define SIMT_VECS(T, N, A2, A4) SIMT_VEC2(T, N, A2) SIMT_VEC3(T, N) SIMT_VEC4(T, N, A4)
SIMT_VECS(signed char, char, 2, 4)
SIMT_VECS(unsigned char, uchar, 2, 4)
SIMT_VECS(short, short, 4, 8)
SIMT_VECS(unsigned short, ushort, 4, 8)
SIMT_VECS(int, int, 8, 16)
SIMT_VECS(unsigned int, uint, 8, 16)
SIMT_VECS(float, float, 8, 16)
SIMT_VECS(long long, longlong, 16, 16)
SIMT_VECS(unsigned long long, ulonglong, 16, 16)
SIMT_VECS(double, double, 16, 16)
#undef SIMT_VECS
#undef SIMT_VEC2
#undef SIMT_VEC3
#undef SIMT_VEC4

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int a = 1, unsigned int b = 1, unsigned int c = 1) : x(a), y(b), z(c) {}
};

// ---- bit casts, integer and conversion intrinsics ---------------------------------------------------------------
template <class To, class From>
inline To simt_bits(const From& v) {
    static_assert(sizeof(To) == sizeof(From), "a bit cast keeps the size");
    To r;
    memcpy(&r, &v, sizeof r);
    return r;
}
inline float __int_as_float(int v) { return simt_bits<float>(v); }
inline float __uint_as_float(unsigned int v) { return simt_bits<float>(v); }
inline int __float_as_int(float v) { return simt_bits<int>(v); }
inline unsigned int __float_as_uint(float v) { return simt_bits<unsigned int>(v); }
inline double __longlong_as_double(long long v) { return simt_bits<double>(v); }
inline long long __double_as_longlong(double v) { return simt_bits<long long>(v); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) { return (unsigned int)(((uint64_t)a * b) >> 32); }
inline int __mulhi(int a, int b) { return (int)(((int64_t)a * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }
inline int __popc(unsigned int v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(int v) { return v ? __builtin_clz((unsigned)v) : 32; }
inline int __clzll(long long v) { return v ? __builtin_clzll((unsigned long long)v) : 64; }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __ffsll(long long v) { return __builtin_ffsll(v); }
inline unsigned int __brev(unsigned int v) {
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
    return r;
}
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const uint64_t v = ((uint64_t)y << 32) | x;
    unsigned int r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned int)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}

// Float to integer with the GPU's cvt.rzi / cvt.rni: NaN -> 0, out of range saturates.
template <class I>
inline I simt_f2i(double v, bool nearest) {
    if (v != v) return 0;
    v = nearest ? nearbyint(v) : trunc(v);
    const double lo = (double)std::numeric_limits<I>::min(), hi = (double)std::numeric_limits<I>::max();
    if (v <= lo) return std::numeric_limits<I>::min();
    if (v >= hi) return std::numeric_limits<I>::max();
    return (I)v;
}
inline int __float2int_rz(float v) { return simt_f2i<int>(v, false); }
inline int __float2int_rn(float v) { return simt_f2i<int>(v, true); }
inline unsigned int __float2uint_rz(float v) { return simt_f2i<unsigned int>(v, false); }
inline unsigned int __float2uint_rn(float v) { return simt_f2i<unsigned int>(v, true); }
inline long long __float2ll_rz(float v) { return simt_f2i<long long>(v, false); }
inline unsigned long long __float2ull_rz(float v) { return simt_f2i<unsigned long long>(v, false); }
inline unsigned long long __float2ull_rn(float v) { return simt_f2i<unsigned long long>(v, true); }
inline unsigned long long __double2ull_rz(double v) { return simt_f2i<unsigned long long>(v, false); }
inline long long __double2ll_rz(double v) { return simt_f2i<long long>(v, false); }
inline int __double2int_rz(double v) { return simt_f2i<int>(v, false); }
inline double __ull2double_rn(unsigned long long v) { return (double)v; }   // correctly rounded (the default mode)
inline double __ll2double_rn(long long v) { return (double)v; }
inline float __ull2float_rn(unsigned long long v) { return (float)v; }
inline float __int2float_rn(int v) { return (float)v; }
inline float __uint2float_rn(unsigned int v) { return (float)v; }
inline double __int2double_rn(int v) { return (double)v; }

// IEEE single arithmetic, exactly the GPU's (round to nearest even, no contraction).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __saturatef(float v) { return v != v ? 0.f : fminf(fmaxf(v, 0.f), 1.f); }
// Not CUDA's approximations: correctly rounded (or glibc's) results (see the header comment).
inline float rsqrtf(float v) { return 1.0f / sqrtf(v); }
inline double rsqrt(double v) { return 1.0 / sqrt(v); }
inline float __expf(float v) { return expf(v); }
inline float __exp2f(float v) { return exp2f(v); }
inline float __logf(float v) { return logf(v); }
inline float __log2f(float v) { return log2f(v); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __sinf(float v) { return sinf(v); }
inline float __cosf(float v) { return cosf(v); }

// CUDA's integer and float min / max overloads.
#define SIMT_MINMAX(T) inline T min(T a, T b) { return a < b ? a : b; } inline T max(T a, T b) { return a > b ? a : b; }
SIMT_MINMAX(int)
SIMT_MINMAX(unsigned int)
SIMT_MINMAX(long)
SIMT_MINMAX(unsigned long)
SIMT_MINMAX(long long)
SIMT_MINMAX(unsigned long long)
#undef SIMT_MINMAX
inline unsigned int min(int a, unsigned int b) { return min((unsigned int)a, b); }
inline unsigned int min(unsigned int a, int b) { return min(a, (unsigned int)b); }
inline unsigned int max(int a, unsigned int b) { return max((unsigned int)a, b); }
inline unsigned int max(unsigned int a, int b) { return max(a, (unsigned int)b); }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline unsigned int umin(unsigned int a, unsigned int b) { return min(a, b); }
inline unsigned int umax(unsigned int a, unsigned int b) { return max(a, b); }

// Address-space conversions (only inline PTX, which the harness does not run, uses their results).
inline size_t __cvta_generic_to_shared(const void* p) { return reinterpret_cast<size_t>(p); }
inline size_t __cvta_generic_to_global(const void* p) { return reinterpret_cast<size_t>(p); }

template <class T>
inline T __ldg(const T* p) { return *p; }
template <class T>
inline T __ldcs(const T* p) { return *p; }
template <class T>
inline T __ldcg(const T* p) { return *p; }
template <class T>
inline void __stcs(T* p, T v) { *p = v; }
template <class T>
inline void __stcg(T* p, T v) { *p = v; }

// ---- bf16 (cuda_bf16.h's names; no implicit conversions, so a kernel's conversions are all spelled out) -------
struct __nv_bfloat16 {
    unsigned short __x;
};
struct __align__(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;
inline float __bfloat162float(__nv_bfloat16 v) { return __uint_as_float((unsigned int)v.__x << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float v) {   // round to nearest even; NaN -> the canonical 0x7fff
    const unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fff};
    return __nv_bfloat16{(unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float v) { return __float2bfloat16_rn(v); }
inline __nv_bfloat16 __float2bfloat16_rz(float v) {
    const unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fff};
    return __nv_bfloat16{(unsigned short)(u >> 16)};
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 v) { return v.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short v) { return __nv_bfloat16{v}; }
inline short __bfloat16_as_short(__nv_bfloat16 v) { return (short)v.__x; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162{a, b}; }
inline float __low2float(__nv_bfloat162 v) { return __bfloat162float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return __bfloat162float(v.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return make_float2(__low2float(v), __high2float(v)); }
// max / min as cuda_bf16.h documents them: a NaN input loses (two NaNs: the canonical NaN), +0 > -0.
inline __nv_bfloat16 simt_bf16_pick(__nv_bfloat16 a, __nv_bfloat16 b, bool want_max) {
    const float x = __bfloat162float(a), y = __bfloat162float(b);
    if (x != x && y != y) return __nv_bfloat16{0x7fff};
    if (x != x) return b;
    if (y != y) return a;
    if (x == y) return ((a.__x >> 15) == (want_max ? 0 : 1)) ? a : b;   // equal values (only +-0 differ in bits)
    return (x > y) == want_max ? a : b;
}
inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) { return simt_bf16_pick(a, b, true); }
inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) { return simt_bf16_pick(a, b, false); }
inline __nv_bfloat162 __hmax2(__nv_bfloat162 a, __nv_bfloat162 b) { return {__hmax(a.x, b.x), __hmax(a.y, b.y)}; }
inline __nv_bfloat162 __hmin2(__nv_bfloat162 a, __nv_bfloat162 b) { return {__hmin(a.x, b.x), __hmin(a.y, b.y)}; }

// ---- the runtime: fibers, the scheduler, barriers and warp calls -----------------------------------------------
namespace simt {

constexpr int MAX_THREADS = 1024;
constexpr size_t STACK_BYTES = 64 * 1024;

enum State : unsigned char { READY, RUNNING, AT_BARRIER, AT_WARP, EXITED };
enum WarpOp : unsigned char { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, BALLOT, ANY, ALL, SYNCWARP, MATCH_ANY,
                              REDUCE_ADD, REDUCE_MIN, REDUCE_MAX, REDUCE_UMIN, REDUCE_UMAX, REDUCE_AND,
                              REDUCE_OR, REDUCE_XOR };
inline const char* const WARP_OP_NAMES[] = {
    "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync", "__ballot_sync", "__any_sync",
    "__all_sync", "__syncwarp", "__match_any_sync", "__reduce_add_sync", "__reduce_min_sync",
    "__reduce_max_sync", "__reduce_min_sync", "__reduce_max_sync", "__reduce_and_sync", "__reduce_or_sync",
    "__reduce_xor_sync"};

struct Site {   // a call site: every thread of a barrier must wait at the same one
    const char* file;
    int line;
    bool operator==(const Site& o) const { return line == o.line && (file == o.file || !strcmp(file, o.file)); }
};

struct Fiber {
    void* sp;             // saved stack pointer (x86-64 switch) or the ucontext below
    uint3 tid;
    int index, lane, warp;
    State state;
    Site site;            // where it waits
    uint64_t out;         // its warp call's result
#if !defined(__x86_64__) || defined(SIMT_UCONTEXT)
    ucontext_t uc;
#endif
};

struct Warp {
    int arrived, size, exited;   // lanes at the pending call; lanes the warp has; lanes that returned
    WarpOp op;
    Site site;
    int width;
    uint64_t in[32];
    int64_t arg[32];
};

struct Block {
    int arrived, count;   // threads at the pending barrier, how many of them passed a true predicate
    int result;           // the last barrier's count
    bool result_all;      // whether every thread of it passed a true predicate
    Site site;
};

struct Config {   // a launch, from the Python side (ctypes mirrors it)
    uint32_t grid[3], block[3];
    uint64_t dynamic_shared;
    int32_t poison;
    uint32_t schedule;   // the order threads run in between waits (sweep's comment)
};

struct Runtime {
    Fiber fibers[MAX_THREADS];
    Warp warps[MAX_THREADS / 32];
    Block block;
    Fiber* cur = nullptr;
    void* main_sp = nullptr;
#if !defined(__x86_64__) || defined(SIMT_UCONTEXT)
    ucontext_t main_uc;
#endif
    int nthreads = 0, live = 0;
    dim3 grid_dim, block_dim;
    uint3 block_idx;
    void (*body)(void* const*) = nullptr;
    void* const* args = nullptr;
    char* stacks = nullptr;          // MAX_THREADS stacks, each above a guard page
    char* dyn = nullptr;             // the dynamic shared memory (its end at a guard page)
    size_t dyn_bytes = 0, dyn_map = 0;
    char* dyn_map_base = nullptr;
    int poison = 0xA5;
    uint32_t schedule = 0;
    uint64_t rand_state = 0;
    int order[MAX_THREADS];
    bool failed = false, running = false;
    char error[4096];
    uintptr_t fault_addr = 0;
    int fault_signal = 0;
    sigjmp_buf fault_jmp;
    char altstack[64 * 1024];
};

inline Runtime rt;

}  // namespace simt

extern "C" char __start_simt_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_simt_shared[] __attribute__((weak, visibility("hidden")));

namespace simt {

// ---- context switch ------------------------------------------------------------------------------------------
#if defined(__x86_64__) && !defined(SIMT_UCONTEXT)
extern "C" void simt_switch(void** save, void* load);
extern "C" void simt_fiber_start();
asm(R"(
    .text
    .p2align 4
    .type simt_switch, @function
simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size simt_switch, .-simt_switch
    .p2align 4
    .type simt_fiber_start, @function
simt_fiber_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size simt_fiber_start, .-simt_fiber_start
)");

// A fresh stack whose first switch enters fn(arg): six callee-saved registers (r13 = fn, r12 = arg), then
// simt_fiber_start as the return address, leaving the stack 16-byte aligned at its call.
inline void make_context(Fiber& f, char* stack_top, void (*fn)(Fiber*)) {
    uint64_t* sp = reinterpret_cast<uint64_t*>(stack_top) - 7;
    sp[0] = 0;                                          // r15
    sp[1] = 0;                                          // r14
    sp[2] = reinterpret_cast<uint64_t>(fn);             // r13
    sp[3] = reinterpret_cast<uint64_t>(&f);             // r12
    sp[4] = 0;                                          // rbx
    sp[5] = 0;                                          // rbp
    sp[6] = reinterpret_cast<uint64_t>(&simt_fiber_start);
    f.sp = sp;
}
inline void to_fiber(Fiber& f) { simt_switch(&rt.main_sp, f.sp); }
inline void to_scheduler(Fiber& f) { simt_switch(&f.sp, rt.main_sp); }
#else
inline void fiber_trampoline(unsigned lo, unsigned hi) {
    Fiber* f = reinterpret_cast<Fiber*>(((uintptr_t)hi << 32) | lo);
    reinterpret_cast<void (*)(Fiber*)>(f->sp)(f);
}
inline void make_context(Fiber& f, char* stack_top, void (*fn)(Fiber*)) {
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = stack_top - STACK_BYTES;
    f.uc.uc_stack.ss_size = STACK_BYTES;
    f.uc.uc_link = nullptr;
    f.sp = reinterpret_cast<void*>(fn);
    const uintptr_t p = reinterpret_cast<uintptr_t>(&f);
    makecontext(&f.uc, (void (*)())fiber_trampoline, 2, (unsigned)p, (unsigned)(p >> 32));
}
inline void to_fiber(Fiber& f) { swapcontext(&rt.main_uc, &f.uc); }
inline void to_scheduler(Fiber& f) { swapcontext(&f.uc, &rt.main_uc); }
#endif

// ---- errors --------------------------------------------------------------------------------------------------
// Records the launch's first error and leaves the CTA: the fibers are abandoned, the launch returns it.
[[noreturn]] __attribute__((format(printf, 1, 2))) inline void fail(const char* fmt, ...) {
    if (!rt.failed) {
        const Fiber* f = rt.cur;
        int n = snprintf(rt.error, sizeof rt.error, "block (%u, %u, %u) thread (%u, %u, %u): ", rt.block_idx.x,
                         rt.block_idx.y, rt.block_idx.z, f ? f->tid.x : 0u, f ? f->tid.y : 0u, f ? f->tid.z : 0u);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(rt.error + n, sizeof rt.error - n, fmt, ap);
        va_end(ap);
        rt.failed = true;
    }
    siglongjmp(rt.fault_jmp, 1);
}

inline const char* state_name(const Fiber& f) {
    static char buf[256];
    switch (f.state) {
        case AT_BARRIER: snprintf(buf, sizeof buf, "__syncthreads (%s:%d)", f.site.file, f.site.line); break;
        case AT_WARP: snprintf(buf, sizeof buf, "%s (%s:%d)", WARP_OP_NAMES[rt.warps[f.warp].op], f.site.file,
                               f.site.line); break;
        case EXITED: return "returned";
        default: return "running";
    }
    return buf;
}

// ---- barriers ------------------------------------------------------------------------------------------------
inline void wait_here(Fiber& f, State s, Site site) {
    f.state = s;
    f.site = site;
    to_scheduler(f);
}

inline void release_block() {
    Block& b = rt.block;
    b.result = b.count;
    b.result_all = b.count == b.arrived;
    b.arrived = 0;
    b.count = 0;
    for (int i = 0; i < rt.nthreads; ++i)
        if (rt.fibers[i].state == AT_BARRIER) rt.fibers[i].state = READY;
}

inline const Block& block_barrier(int pred, Site site) {
    Fiber& f = *rt.cur;
    Block& b = rt.block;
    const Warp& w = rt.warps[f.warp];
    if (w.arrived)
        fail("__syncthreads (%s:%d) while %d lanes of warp %d wait at %s (%s:%d): a deadlock on the GPU", site.file,
             site.line, w.arrived, f.warp, WARP_OP_NAMES[w.op], w.site.file, w.site.line);
    if (b.arrived && !(b.site == site))
        fail("__syncthreads at %s:%d while %d threads wait at %s:%d (a barrier in divergent code)", site.file,
             site.line, b.arrived, b.site.file, b.site.line);
    b.site = site;
    b.count += pred != 0;
    if (++b.arrived == rt.live) {
        release_block();
        f.state = RUNNING;
    } else {
        wait_here(f, AT_BARRIER, site);
    }
    return b;
}

// ---- warp calls ----------------------------------------------------------------------------------------------
inline void complete_warp(Warp& w, int base) {
    const int width = w.width;
    uint64_t all = 0, any = 0, every = 1;
    for (int l = 0; l < 32; ++l) {
        all |= (uint64_t)(w.in[l] != 0) << l;
        any |= w.in[l] != 0;
        every &= w.in[l] != 0;
    }
    const int segmask = (32 - width) & 31;
    for (int l = 0; l < 32; ++l) {
        Fiber& f = rt.fibers[base + l];
        const int64_t b = w.arg[l];
        // PTX shfl.sync: maxLane / minLane of the lane's segment, j the source lane (out of range: the lane's own)
        const int min_lane = l & segmask, max_lane = min_lane | (31 & ~segmask);
        int64_t j = l;
        bool ok = true;
        uint64_t r = 0;
        switch (w.op) {
            case SHFL_IDX: j = min_lane | (b & 31 & ~segmask); ok = j <= max_lane; break;
            case SHFL_UP: j = l - b; ok = j >= min_lane; break;
            case SHFL_DOWN: j = l + b; ok = j <= max_lane; break;
            case SHFL_XOR: j = l ^ b; ok = j <= max_lane; break;
            case BALLOT: r = all; break;
            case ANY: r = any; break;
            case ALL: r = every; break;
            case SYNCWARP: break;
            case MATCH_ANY:
                for (int k = 0; k < 32; ++k) r |= (uint64_t)(w.in[k] == w.in[l]) << k;
                break;
            default: {
                uint32_t acc = (uint32_t)w.in[0];
                for (int k = 1; k < 32; ++k) {
                    const uint32_t v = (uint32_t)w.in[k];
                    switch (w.op) {
                        case REDUCE_ADD: acc += v; break;
                        case REDUCE_MIN: acc = (uint32_t)std::min((int32_t)acc, (int32_t)v); break;
                        case REDUCE_MAX: acc = (uint32_t)std::max((int32_t)acc, (int32_t)v); break;
                        case REDUCE_UMIN: acc = std::min(acc, v); break;
                        case REDUCE_UMAX: acc = std::max(acc, v); break;
                        case REDUCE_AND: acc &= v; break;
                        case REDUCE_OR: acc |= v; break;
                        default: acc ^= v; break;
                    }
                }
                r = acc;
            }
        }
        if (w.op <= SHFL_XOR) r = w.in[ok ? j : l];
        f.out = r;
        if (f.state == AT_WARP) f.state = READY;
    }
}

inline uint64_t warp_call(WarpOp op, unsigned mask, uint64_t in, int64_t arg, int width, Site site) {
    Fiber& f = *rt.cur;
    Warp& w = rt.warps[f.warp];
    const char* name = WARP_OP_NAMES[op];
    if (mask != 0xffffffffu)
        fail("%s (%s:%d) with mask 0x%08x: the harness supports full-warp masks only", name, site.file, site.line,
             mask);
    if (w.size != 32)
        fail("%s (%s:%d) in warp %d of %d lanes: a full mask names lanes that do not exist", name, site.file,
             site.line, f.warp, w.size);
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail("%s (%s:%d): width %d is not a power of two in 1..32", name, site.file, site.line, width);
    if (w.exited) {
        int l = 0;
        while (rt.fibers[f.warp * 32 + l].state != EXITED) ++l;
        fail("%s (%s:%d) reached by a partial warp: lane %d of warp %d returned (undefined on the GPU)", name,
             site.file, site.line, l, f.warp);
    }
    if (w.arrived && !(w.op == op && w.site == site && w.width == width))
        fail("%s (%s:%d) while %d lanes of warp %d wait at %s (%s:%d): the lanes diverged", name, site.file,
             site.line, w.arrived, f.warp, WARP_OP_NAMES[w.op], w.site.file, w.site.line);
    for (int l = 0; l < 32; ++l) {
        const Fiber& o = rt.fibers[f.warp * 32 + l];
        if (o.state == AT_BARRIER)
            fail("%s (%s:%d) while lane %d of warp %d waits at __syncthreads (%s:%d): a deadlock on the GPU", name,
                 site.file, site.line, l, f.warp, o.site.file, o.site.line);
    }
    w.op = op;
    w.site = site;
    w.width = width;
    w.in[f.lane] = in;
    w.arg[f.lane] = arg;
    if (++w.arrived == 32) {
        w.arrived = 0;
        complete_warp(w, f.warp * 32);
        f.state = RUNNING;
    } else {
        wait_here(f, AT_WARP, site);
    }
    return f.out;
}

template <class T>
inline uint64_t to_word(const T& v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "warp calls move values of at most 8 bytes");
    uint64_t r = 0;
    memcpy(&r, &v, sizeof v);
    return r;
}
template <class T>
inline T from_word(uint64_t v) {
    T r;
    memcpy(&r, &v, sizeof r);
    return r;
}

// ---- fibers and the CTA scheduler -----------------------------------------------------------------------------
inline void on_exit(Fiber& f) {
    Warp& w = rt.warps[f.warp];
    if (w.arrived)
        fail("returned while %d lanes of warp %d wait at %s (%s:%d): a partial warp (undefined on the GPU)",
             w.arrived, f.warp, WARP_OP_NAMES[w.op], w.site.file, w.site.line);
    f.state = EXITED;
    ++w.exited;
    --rt.live;
    if (rt.block.arrived && rt.block.arrived == rt.live) release_block();
}

inline void fiber_main(Fiber* f) {
    rt.body(rt.args);
    on_exit(*f);
    to_scheduler(*f);
    __builtin_trap();   // never resumed
}

inline void describe_deadlock() {
    int n = snprintf(rt.error, sizeof rt.error, "block (%u, %u, %u): no thread can go on:", rt.block_idx.x,
                     rt.block_idx.y, rt.block_idx.z);
    for (int i = 0; i < rt.nthreads && n < (int)sizeof rt.error - 200; ++i) {
        const Fiber& f = rt.fibers[i];
        if (f.state == EXITED) continue;
        int j = i;
        while (j + 1 < rt.nthreads && rt.fibers[j + 1].state == f.state && rt.fibers[j + 1].site == f.site) ++j;
        n += snprintf(rt.error + n, sizeof rt.error - n, " threads %d..%d at %s;", i, j, state_name(f));
        i = j;
    }
    rt.failed = true;
}

inline void map_stacks() {
    if (rt.stacks) return;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), slot = STACK_BYTES + page;
    void* p = mmap(nullptr, slot * MAX_THREADS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) {
        perror("simt: mmap of the fiber stacks");
        abort();
    }
    rt.stacks = static_cast<char*>(p);
    for (int i = 0; i < MAX_THREADS; ++i) mprotect(rt.stacks + i * slot, page, PROT_NONE);
}

inline char* stack_top(int i) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return rt.stacks + (i + 1) * (STACK_BYTES + page);
}

inline uint64_t next_random() {   // xorshift64: the same seed, the same schedule
    rt.rand_state ^= rt.rand_state << 13;
    rt.rand_state ^= rt.rand_state >> 7;
    rt.rand_state ^= rt.rand_state << 17;
    return rt.rand_state;
}

inline void permute(int* a, int n) {
    for (int i = n - 1; i > 0; --i) std::swap(a[i], a[next_random() % (uint64_t)(i + 1)]);
}

inline bool run_fiber(int i) {
    Fiber& f = rt.fibers[i];
    if (f.state != READY) return false;
    f.state = RUNNING;
    rt.cur = &f;
    to_fiber(f);
    rt.cur = nullptr;
    return true;
}

// One pass over the runnable threads, each running to its next wait: thread by thread (ascending, descending or a
// random order), or warp by warp, each warp run until none of its lanes can go on (so it may get far ahead of the
// others: an inter-warp race shows). Schedules: 0 / 1 threads ascending / descending, 2 / 3 warps ascending /
// descending, else random (per pass: thread or warp order, and the orders themselves).
inline bool sweep() {
    const int n = rt.nthreads, nwarps = (n + 31) / 32;
    const uint32_t s = rt.schedule;
    const bool random = s > 3, by_warp = random ? (next_random() >> 20) & 1 : s >= 2;
    bool ran = false;
    if (!by_warp) {
        for (int i = 0; i < n; ++i) rt.order[i] = s == 1 ? n - 1 - i : i;
        if (random) permute(rt.order, n);
        for (int k = 0; k < n; ++k) ran |= run_fiber(rt.order[k]);
        return ran;
    }
    int warps[MAX_THREADS / 32], lanes[32];
    for (int w = 0; w < nwarps; ++w) warps[w] = s == 3 ? nwarps - 1 - w : w;
    for (int l = 0; l < 32; ++l) lanes[l] = l;
    if (random) {
        permute(warps, nwarps);
        permute(lanes, 32);
    }
    for (int k = 0; k < nwarps; ++k) {
        for (bool more = true; more;) {
            more = false;
            for (int l : lanes)
                if (32 * warps[k] + l < n) more |= run_fiber(32 * warps[k] + l);
            ran |= more;
        }
    }
    return ran;
}

// One CTA: poison the shared memory, start every thread, then sweep the runnable threads until all returned (a
// barrier's or warp call's last arrival releases the others and runs on).
inline void run_block() {
    char* const s0 = __start_simt_shared;
    if (s0) memset(s0, rt.poison, (size_t)(__stop_simt_shared - s0));
    if (rt.dyn) memset(rt.dyn, rt.poison, (size_t)(rt.dyn_map_base + rt.dyn_map - rt.dyn));
    rt.block = Block{};
    const int nwarps = (rt.nthreads + 31) / 32;
    for (int w = 0; w < nwarps; ++w) {
        rt.warps[w] = Warp{};
        rt.warps[w].size = std::min(32, rt.nthreads - 32 * w);
    }
    for (int i = 0; i < rt.nthreads; ++i) {
        Fiber& f = rt.fibers[i];
        f.index = i;
        f.lane = i & 31;
        f.warp = i >> 5;
        f.tid = uint3{i % rt.block_dim.x, (i / rt.block_dim.x) % rt.block_dim.y,
                      i / (rt.block_dim.x * rt.block_dim.y)};
        f.state = READY;
        f.site = Site{"", 0};
        make_context(f, stack_top(i), fiber_main);
    }
    rt.live = rt.nthreads;
    while (rt.live > 0) {
        if (!sweep()) {
            describe_deadlock();
            return;
        }
    }
}

inline void on_signal(int sig, siginfo_t* info, void*) {
    if (!rt.running) {   // not ours: the previous disposition takes it when the instruction repeats
        signal(sig, SIG_DFL);
        return;
    }
    rt.fault_signal = sig;
    rt.fault_addr = reinterpret_cast<uintptr_t>(info->si_addr);
    siglongjmp(rt.fault_jmp, 2);
}

// The dynamic shared memory: `bytes` (rounded up to 16, the pad poisoned too) ending at a guard page.
inline bool map_dynamic(size_t bytes) {
    if (rt.dyn_map_base) munmap(rt.dyn_map_base, rt.dyn_map + (size_t)sysconf(_SC_PAGESIZE));
    rt.dyn = rt.dyn_map_base = nullptr;
    rt.dyn_bytes = bytes;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), rounded = (bytes + 15) & ~(size_t)15;
    rt.dyn_map = (rounded + page - 1) / page * page;
    if (!rt.dyn_map) return true;
    void* p = mmap(nullptr, rt.dyn_map + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    rt.dyn_map_base = static_cast<char*>(p);
    mprotect(rt.dyn_map_base + rt.dyn_map, page, PROT_NONE);
    rt.dyn = rt.dyn_map_base + rt.dyn_map - rounded;
    return true;
}

inline void describe_fault() {
    const char* what = rt.fault_signal == SIGFPE ? "an integer division by zero or overflow"
                     : rt.fault_signal == SIGILL ? "a trap"
                     : "an invalid memory access";
    const Fiber* f = rt.cur;
    int n = snprintf(rt.error, sizeof rt.error, "block (%u, %u, %u) thread (%u, %u, %u): %s at address 0x%lx",
                     rt.block_idx.x, rt.block_idx.y, rt.block_idx.z, f ? f->tid.x : 0u, f ? f->tid.y : 0u,
                     f ? f->tid.z : 0u, what, (unsigned long)rt.fault_addr);
    const uintptr_t a = rt.fault_addr, page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t st = reinterpret_cast<uintptr_t>(rt.stacks);
    const uintptr_t d0 = reinterpret_cast<uintptr_t>(rt.dyn_map_base);
    if (d0 && a >= d0 && a < d0 + rt.dyn_map + page)
        snprintf(rt.error + n, sizeof rt.error - n, " (past the %zu bytes of dynamic shared memory)", rt.dyn_bytes);
    else if (st && a >= st && a < st + MAX_THREADS * (STACK_BYTES + page) && (a - st) % (STACK_BYTES + page) < page)
        snprintf(rt.error + n, sizeof rt.error - n, " (a stack overflow: %zu KiB a thread)", STACK_BYTES / 1024);
    rt.failed = true;
}

// One launch: every CTA in blockIdx order (x fastest). 0: done; 1: rt.error says why.
inline int launch(const Config* c, void* const* args, void (*body)(void* const*)) {
    if (rt.running) {
        snprintf(rt.error, sizeof rt.error, "a launch is already running");
        return 1;
    }
    rt.failed = false;
    rt.error[0] = 0;
    const uint64_t nthreads = (uint64_t)c->block[0] * c->block[1] * c->block[2];
    if (!nthreads || nthreads > MAX_THREADS || !c->grid[0] || !c->grid[1] || !c->grid[2]) {
        snprintf(rt.error, sizeof rt.error, "block (%u, %u, %u) of grid (%u, %u, %u): at most %d threads, none empty",
                 c->block[0], c->block[1], c->block[2], c->grid[0], c->grid[1], c->grid[2], MAX_THREADS);
        return 1;
    }
    map_stacks();
    if (!map_dynamic(c->dynamic_shared)) {
        snprintf(rt.error, sizeof rt.error, "cannot map %llu bytes of dynamic shared memory",
                 (unsigned long long)c->dynamic_shared);
        return 1;
    }
    rt.nthreads = (int)nthreads;
    rt.block_dim = dim3(c->block[0], c->block[1], c->block[2]);
    rt.grid_dim = dim3(c->grid[0], c->grid[1], c->grid[2]);
    rt.poison = c->poison & 0xff;
    rt.schedule = c->schedule;
    rt.rand_state = 0x9E3779B97F4A7C15ull * ((uint64_t)c->schedule + 1);   // never 0
    rt.body = body;
    rt.args = args;
    rt.cur = nullptr;
    stack_t alt{}, old_alt{};
    alt.ss_sp = rt.altstack;
    alt.ss_size = sizeof rt.altstack;
    sigaltstack(&alt, &old_alt);
    struct sigaction sa{}, old[4];
    const int sigs[4] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 4; ++i) sigaction(sigs[i], &sa, &old[i]);
    rt.running = true;
    const int jumped = sigsetjmp(rt.fault_jmp, 1);
    if (jumped == 2) describe_fault();
    if (!jumped) {
        for (unsigned z = 0; z < rt.grid_dim.z && !rt.failed; ++z)
            for (unsigned y = 0; y < rt.grid_dim.y && !rt.failed; ++y)
                for (unsigned x = 0; x < rt.grid_dim.x && !rt.failed; ++x) {
                    rt.block_idx = uint3{x, y, z};
                    run_block();
                }
    }
    rt.running = false;
    rt.cur = nullptr;
    for (int i = 0; i < 4; ++i) sigaction(sigs[i], &old[i], nullptr);
    sigaltstack(&old_alt, nullptr);
    if (!rt.failed && rt.dyn) {   // the pad past the requested bytes must keep the poison
        for (char* p = rt.dyn + rt.dyn_bytes; p < rt.dyn_map_base + rt.dyn_map; ++p)
            if ((unsigned char)*p != rt.poison) {
                snprintf(rt.error, sizeof rt.error, "a write past the %zu bytes of dynamic shared memory (at byte %zu)",
                         rt.dyn_bytes, (size_t)(p - rt.dyn));
                rt.failed = true;
                break;
            }
    }
    return rt.failed ? 1 : 0;
}

// The kernel's parameters as hss kinds (ptr, i32, u32, i64, u64, f32, f64), comma-separated.
template <class T>
constexpr const char* kind_of() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<U>) return "ptr";
    else if constexpr (std::is_same_v<U, float>) return "f32";
    else if constexpr (std::is_same_v<U, double>) return "f64";
    else if constexpr (std::is_integral_v<U> && sizeof(U) == 4) return std::is_signed_v<U> ? "i32" : "u32";
    else if constexpr (std::is_integral_v<U> && sizeof(U) == 8) return std::is_signed_v<U> ? "i64" : "u64";
    else return "unsupported";
}

template <class... A>
struct Signature;
template <class... A>
struct Signature<void (*)(A...)> {
    static const char* kinds() {
        static char buf[1024];
        buf[0] = 0;
        ((strcat(buf, kind_of<A>()), strcat(buf, ",")), ...);
        if (buf[0]) buf[strlen(buf) - 1] = 0;
        return buf;
    }
    template <size_t... I>
    static void call(void (*k)(A...), void* const* a, std::index_sequence<I...>) {
        k(*static_cast<std::remove_cv_t<A>*>(a[I])...);
    }
    template <void (*K)(A...)>
    static void body(void* const* a) { call(K, a, std::index_sequence_for<A...>{}); }
};

}  // namespace simt

// ---- the CUDA names over the runtime ---------------------------------------------------------------------------
#define threadIdx (::simt::rt.cur->tid)
#define blockIdx (::simt::rt.block_idx)
#define blockDim (::simt::rt.block_dim)
#define gridDim (::simt::rt.grid_dim)
#define warpSize 32
#define SIMT_SITE const char* simt_file = __builtin_FILE(), int simt_line = __builtin_LINE()
#define SIMT_AT ::simt::Site{simt_file, simt_line}

__attribute__((noinline)) inline void __syncthreads(SIMT_SITE) { ::simt::block_barrier(0, SIMT_AT); }
__attribute__((noinline)) inline int __syncthreads_count(int p, SIMT_SITE) {
    return ::simt::block_barrier(p, SIMT_AT).result;
}
__attribute__((noinline)) inline int __syncthreads_or(int p, SIMT_SITE) {
    return ::simt::block_barrier(p, SIMT_AT).result > 0;
}
__attribute__((noinline)) inline int __syncthreads_and(int p, SIMT_SITE) {
    return ::simt::block_barrier(p, SIMT_AT).result_all;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

template <class T>
__attribute__((noinline)) T __shfl_sync(unsigned mask, T v, int src, int width = 32, SIMT_SITE) {
    return ::simt::from_word<T>(::simt::warp_call(::simt::SHFL_IDX, mask, ::simt::to_word(v), src, width, SIMT_AT));
}
template <class T>
__attribute__((noinline)) T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32, SIMT_SITE) {
    return ::simt::from_word<T>(::simt::warp_call(::simt::SHFL_UP, mask, ::simt::to_word(v), delta, width, SIMT_AT));
}
template <class T>
__attribute__((noinline)) T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32, SIMT_SITE) {
    return ::simt::from_word<T>(::simt::warp_call(::simt::SHFL_DOWN, mask, ::simt::to_word(v), delta, width,
                                                  SIMT_AT));
}
template <class T>
__attribute__((noinline)) T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32, SIMT_SITE) {
    return ::simt::from_word<T>(::simt::warp_call(::simt::SHFL_XOR, mask, ::simt::to_word(v), lane_mask, width,
                                                  SIMT_AT));
}
__attribute__((noinline)) inline unsigned __ballot_sync(unsigned mask, int p, SIMT_SITE) {
    return (unsigned)::simt::warp_call(::simt::BALLOT, mask, p != 0, 0, 32, SIMT_AT);
}
__attribute__((noinline)) inline int __any_sync(unsigned mask, int p, SIMT_SITE) {
    return (int)::simt::warp_call(::simt::ANY, mask, p != 0, 0, 32, SIMT_AT);
}
__attribute__((noinline)) inline int __all_sync(unsigned mask, int p, SIMT_SITE) {
    return (int)::simt::warp_call(::simt::ALL, mask, p != 0, 0, 32, SIMT_AT);
}
__attribute__((noinline)) inline void __syncwarp(unsigned mask = 0xffffffffu, SIMT_SITE) {
    ::simt::warp_call(::simt::SYNCWARP, mask, 0, 0, 32, SIMT_AT);
}
template <class T>
__attribute__((noinline)) unsigned __match_any_sync(unsigned mask, T v, SIMT_SITE) {
    return (unsigned)::simt::warp_call(::simt::MATCH_ANY, mask, ::simt::to_word(v), 0, 32, SIMT_AT);
}
#define SIMT_REDUCE(name, T, OP) \
    __attribute__((noinline)) inline T name(unsigned mask, T v, SIMT_SITE) { \
        return (T)::simt::warp_call(::simt::OP, mask, (uint32_t)v, 0, 32, SIMT_AT); \
    }
SIMT_REDUCE(__reduce_add_sync, unsigned, REDUCE_ADD)
SIMT_REDUCE(__reduce_add_sync, int, REDUCE_ADD)
SIMT_REDUCE(__reduce_min_sync, unsigned, REDUCE_UMIN)
SIMT_REDUCE(__reduce_min_sync, int, REDUCE_MIN)
SIMT_REDUCE(__reduce_max_sync, unsigned, REDUCE_UMAX)
SIMT_REDUCE(__reduce_max_sync, int, REDUCE_MAX)
SIMT_REDUCE(__reduce_and_sync, unsigned, REDUCE_AND)
SIMT_REDUCE(__reduce_or_sync, unsigned, REDUCE_OR)
SIMT_REDUCE(__reduce_xor_sync, unsigned, REDUCE_XOR)
#undef SIMT_REDUCE
// The lanes of the warp that have not returned (the harness has no notion of divergent lanes).
inline unsigned __activemask() {
    const int w = ::simt::rt.cur->warp;
    unsigned m = 0;
    for (int l = 0; l < ::simt::rt.warps[w].size; ++l)
        if (::simt::rt.fibers[32 * w + l].state != ::simt::EXITED) m |= 1u << l;
    return m;
}
inline unsigned __lanemask_lt() { return (1u << (::simt::rt.cur->lane)) - 1u; }

// ---- atomics: plain read-modify-writes (a fiber never switches inside one) --------------------------------------
#define SIMT_ATOMIC(name, T, EXPR) inline T name(T* p, T v) { const T old = *p; *p = (EXPR); return old; }
#define SIMT_ATOMIC_INT(T) \
    SIMT_ATOMIC(atomicAdd, T, old + v) SIMT_ATOMIC(atomicSub, T, old - v) SIMT_ATOMIC(atomicExch, T, v) \
    SIMT_ATOMIC(atomicMin, T, v < old ? v : old) SIMT_ATOMIC(atomicMax, T, v > old ? v : old) \
    SIMT_ATOMIC(atomicAnd, T, old & v) SIMT_ATOMIC(atomicOr, T, old | v) SIMT_ATOMIC(atomicXor, T, old ^ v) \
    inline T atomicCAS(T* p, T cmp, T v) { const T old = *p; if (old == cmp) *p = v; return old; }
SIMT_ATOMIC_INT(int)
SIMT_ATOMIC_INT(unsigned int)
SIMT_ATOMIC_INT(long long)
SIMT_ATOMIC_INT(unsigned long long)
SIMT_ATOMIC(atomicAdd, float, old + v)
SIMT_ATOMIC(atomicAdd, double, old + v)
SIMT_ATOMIC(atomicExch, float, v)
#undef SIMT_ATOMIC_INT
#undef SIMT_ATOMIC
inline unsigned atomicInc(unsigned* p, unsigned v) { const unsigned o = *p; *p = o >= v ? 0u : o + 1u; return o; }
inline unsigned atomicDec(unsigned* p, unsigned v) {
    const unsigned o = *p;
    *p = (o == 0u || o > v) ? v : o - 1u;
    return o;
}

namespace simt {
// ---- the tensor-core and async-copy PTX of ptx/hss_mma.cuh and ptx/hss_async.cuh (the Python side rewrites those
// asm statements into these calls) -------------------------------------------------------------------------------
// A shared-space address is the low 32 bits of a generic one (hss's headers truncate __cvta_generic_to_shared):
// the static section or the dynamic buffer holding it gives back the whole pointer.
inline char* shared_ptr(uint32_t s, size_t bytes) {
    char* const regions[2][2] = {{__start_simt_shared, __stop_simt_shared}, {rt.dyn, rt.dyn + rt.dyn_bytes}};
    for (auto& r : regions) {
        if (!r[0] || r[1] <= r[0]) continue;
        const uint64_t base = reinterpret_cast<uint64_t>(r[0]);
        uint64_t cand = (base & ~0xffffffffull) | s;
        if (cand < base) cand += 1ull << 32;
        char* p = reinterpret_cast<char*>(cand);
        if (p >= r[0] && p + bytes <= r[1]) return p;
    }
    fail("shared-space address 0x%08x (%zu bytes) is in neither static nor dynamic shared memory", s, bytes);
}

// One warp's fragments in flight: every lane posts its words, the warp meets, each lane reads what it needs, the warp
// meets again before the slots can be reused.
struct TensorSlots {
    uint64_t word[32][10];
};
inline TensorSlots& tensor_slots() {
    static TensorSlots slots[1024 / 32];
    return slots[rt.cur->warp];
}

inline float bf16_lo(uint32_t w) { return simt_bits<float>(w << 16); }
inline float bf16_hi(uint32_t w) { return simt_bits<float>(w & 0xffff0000u); }

// ldmatrix .m8n8 .b16, `count` matrices (1, 2 or 4): lanes 8i .. 8i + 7 give matrix i's row addresses; register i
// of lane l gets matrix i's row l / 4, elements 2(l % 4) .. +1 (trans: its column l / 4, rows 2(l % 4) .. +1).
inline void ldmatrix(uint32_t* r, uint32_t s, int count, bool trans, Site site) {
    TensorSlots& t = tensor_slots();
    const int lane = rt.cur->lane;
    t.word[lane][0] = s;
    warp_call(SYNCWARP, 0xffffffffu, 0, 0, 32, site);
    for (int i = 0; i < count; ++i) {
        if (!trans) {
            const char* row = shared_ptr((uint32_t)t.word[8 * i + lane / 4][0], 16);
            memcpy(&r[i], row + 4 * (lane % 4), 4);
        } else {
            uint16_t lo, hi;
            memcpy(&lo, shared_ptr((uint32_t)t.word[8 * i + 2 * (lane % 4)][0], 16) + 2 * (lane / 4), 2);
            memcpy(&hi, shared_ptr((uint32_t)t.word[8 * i + 2 * (lane % 4) + 1][0], 16) + 2 * (lane / 4), 2);
            r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
    }
    warp_call(SYNCWARP, 0xffffffffu, 0, 0, 32, site);
}

// mma.sync .m16n8k16 / .m16n8k8 .row.col .f32.bf16.bf16.f32, D = A B + C in place (fragments as hss_mma.cuh says):
// the products are exact, their sum with C is taken in double and rounded once to f32 (a GPU's tensor cores add in
// an order and with a truncation of their own, so bits may differ from a GPU's: compare with bounds).
inline void mma_bf16(float* d, const uint32_t* a, int na, const uint32_t* b, int nb, int k, Site site) {
    TensorSlots& t = tensor_slots();
    const int lane = rt.cur->lane, g = lane / 4, c = lane % 4;
    for (int i = 0; i < na; ++i) t.word[lane][i] = a[i];
    for (int i = 0; i < nb; ++i) t.word[lane][4 + i] = b[i];
    warp_call(SYNCWARP, 0xffffffffu, 0, 0, 32, site);
    // A[row][kk] and B[kk][col] from the lanes holding them
    auto A = [&](int row, int kk) -> double {
        const int reg = (row >= 8 ? 1 : 0) + (kk >= 8 ? 2 : 0), holder = 4 * (row % 8) + (kk % 8) / 2;
        const uint32_t w = (uint32_t)t.word[holder][reg];
        return (kk & 1) ? bf16_hi(w) : bf16_lo(w);
    };
    auto B = [&](int kk, int col) -> double {
        const int reg = kk >= 8 ? 1 : 0, holder = 4 * col + (kk % 8) / 2;
        const uint32_t w = (uint32_t)t.word[holder][4 + reg];
        return (kk & 1) ? bf16_hi(w) : bf16_lo(w);
    };
    float out[4];
    for (int e = 0; e < 4; ++e) {
        const int row = g + (e >= 2 ? 8 : 0), col = 2 * c + (e & 1);
        double acc = d[e];
        for (int kk = 0; kk < k; ++kk) acc += A(row, kk) * B(kk, col);
        out[e] = (float)acc;
    }
    warp_call(SYNCWARP, 0xffffffffu, 0, 0, 32, site);
    for (int e = 0; e < 4; ++e) d[e] = out[e];
}

// .ftz f32 arithmetic (hss_headscore.cuh): subnormal inputs and results flushed to a zero of their sign; ex2.approx
// is glibc's exp2f (a GPU's is within 2 ulp of it: compare with bounds).
inline float ftz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
inline float sub_ftz(float a, float b) { return ftz(ftz(a) - ftz(b)); }
inline float mul_ftz(float a, float b) { return ftz(ftz(a) * ftz(b)); }
inline float add_ftz(float a, float b) { return ftz(ftz(a) + ftz(b)); }
inline float ex2_ftz(float x) { return ftz(exp2f(ftz(x))); }

// cp.async of 16 bytes: done at once (the wait is then a no-op; a missing wait or barrier shows only on a GPU).
inline void cp_async16(uint32_t s, const void* g) { memcpy(shared_ptr(s, 16), g, 16); }

inline void* dynamic_shared() { return rt.dyn; }
inline unsigned dynamic_smem_size() { return (unsigned)rt.dyn_bytes; }
[[noreturn]] inline void unsupported(const char* what, const char* file, int line) {
    fail("%s (%s:%d) is not supported by the CPU harness", what, file, line);
}
}  // namespace simt

// One kernel's C entry points for the Python side: simt_launch_<k>(config, args) (args[i] points at parameter i,
// of its exact type; returns 0, or 1 with simt_error() saying why) and simt_kinds_<k>() (the parameter kinds).
#define SIMT_EXPORT(k) \
    extern "C" __attribute__((visibility("default"))) int simt_launch_##k(const ::simt::Config* c, void* const* a) { \
        using S = ::simt::Signature<decltype(&k)>; \
        return ::simt::launch(c, a, &S::template body<&k>); \
    } \
    extern "C" __attribute__((visibility("default"))) const char* simt_kinds_##k() { \
        return ::simt::Signature<decltype(&k)>::kinds(); \
    }

extern "C" __attribute__((visibility("default"), used)) inline const char* simt_error() { return ::simt::rt.error; }
