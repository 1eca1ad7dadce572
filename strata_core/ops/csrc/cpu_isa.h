// The instruction set the CPU kernels run with (cpu_experts.cpp chooses it, and
// strata::cpu_kernel_limit_isa caps it for tests): 0 generic, 1 AVX2, 2 AVX-512.
#pragma once

namespace strata_cpu {
int chosen_isa();
}  // namespace strata_cpu
