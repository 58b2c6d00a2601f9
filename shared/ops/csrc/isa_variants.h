// Compiles the kernel file named by BATON_IMPL once per instruction-set level (see cpu_isa.h), each copy in
// the level's namespace and, on x86-64, inside a `#pragma GCC target` region for that level: the functions,
// templates and lambdas defined there may use its instructions; the rest of the library stays at the
// baseline. BATON_ISA holds the level while its copy compiles. Included once per kernel file, after every
// system and torch header that file needs (those must keep the baseline). Elsewhere than x86-64 each level's
// copy is the portable code, which cpu_isa.cpp never picks.
//
// A kernel with tile paths defines BATON_IMPL_AMX too: it gets a fifth copy, in namespace amx, compiled with
// AMX-TILE, AMX-BF16 and AMX-INT8 (the others take avx512_bf16's kernels at the amx level; cpu_isa.cpp).
//
// No `#pragma once`: each kernel file includes this for its own BATON_IMPL.
#if !defined(BATON_IMPL)
#error "define BATON_IMPL (the *_impl.h to compile per level) before including isa_variants.h"
#endif

#define BATON_ISA BATON_ISA_PORTABLE
namespace portable {
#include BATON_IMPL
}  // namespace portable
#undef BATON_ISA

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define BATON_ISA BATON_ISA_AVX2
namespace avx2 {
#include BATON_IMPL
}  // namespace avx2
#undef BATON_ISA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512")
#define BATON_ISA BATON_ISA_AVX512
namespace avx512 {
#include BATON_IMPL
}  // namespace avx512
#undef BATON_ISA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,prefer-vector-width=512")
#define BATON_ISA BATON_ISA_AVX512_BF16
namespace avx512_bf16 {
#include BATON_IMPL
}  // namespace avx512_bf16
#undef BATON_ISA
#pragma GCC pop_options

#if defined(BATON_IMPL_AMX)
#pragma GCC push_options
#pragma GCC target( \
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,amx-tile,amx-bf16,amx-int8,prefer-vector-width=512")
#define BATON_ISA BATON_ISA_AMX
namespace amx {
#include BATON_IMPL
}  // namespace amx
#undef BATON_ISA
#pragma GCC pop_options
#endif
#else
#define BATON_ISA BATON_ISA_PORTABLE
namespace avx2 {
#include BATON_IMPL
}  // namespace avx2
namespace avx512 {
#include BATON_IMPL
}  // namespace avx512
namespace avx512_bf16 {
#include BATON_IMPL
}  // namespace avx512_bf16
#if defined(BATON_IMPL_AMX)
namespace amx {
#include BATON_IMPL
}  // namespace amx
#endif
#undef BATON_ISA
#endif
#undef BATON_IMPL
#undef BATON_IMPL_AMX
