// The instruction set the CPU kernels run with (cpu_experts.cpp chooses it, and
// strata::cpu_kernel_limit_isa caps it for tests): 0 generic, 1 AVX2, 2 AVX-512, 3 AVX-512 VNNI (the
// expert products' int8 body, cpu_experts.cpp; every other kernel runs its AVX-512 body there).
#pragma once

namespace strata_cpu {
int chosen_isa();

// The body for the chosen instruction set, of one compiled for each.
template <typename Fn>
Fn for_isa(Fn avx512, Fn avx2, Fn generic) {
  switch (chosen_isa()) {
    case 3:
    case 2: return avx512;
    case 1: return avx2;
    default: return generic;
  }
}
}  // namespace strata_cpu

// The targets a body is compiled for (each kernel file instantiates its body once per target).
#define STRATA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define STRATA_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define STRATA_AVX2 __attribute__((target("avx2,fma,f16c")))
