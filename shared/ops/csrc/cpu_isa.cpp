// Which instruction-set level the CPU kernels run at (cpu_isa.h): detection, the tables, and the ops that
// read and set the choice (shared/ops/cpu_isa.py logs it at start-up).
//
// A level counts as supported when the CPU has its instructions (cpuid) and the OS saves their registers
// (xgetbv), and for AMX when Linux also grants this process the tile data (arch_prctl, as every AMX user
// must ask). The amx level brings the tile bf16 GEMV; its other kernels are avx512_bf16's (a TDPBUSD W8A8
// was tried: its per-block fold of the tile sums left it 0.86-1.27x of vpdpbusd, so W8A8 stays on VNNI).
#include "cpu_isa.h"
#include "steal_for.h"

#include <array>
#include <atomic>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr std::array<const char*, 5> kNames = {"portable", "avx2", "avx512", "avx512_bf16", "amx"};

const KernelTable kTables[] = {
    {Isa::kPortable, &portable::gemv_f32, &portable::gemv_bf16, &portable::paged_decode, &portable::qgemv_rows,
     &portable::w8a8_rows, &portable::prefill_attention},
    {Isa::kAvx2, &avx2::gemv_f32, &avx2::gemv_bf16, &avx2::paged_decode, &avx2::qgemv_rows, &avx2::w8a8_rows,
     &avx2::prefill_attention},
    {Isa::kAvx512, &avx512::gemv_f32, &avx512::gemv_bf16, &avx512::paged_decode, &avx512::qgemv_rows,
     &avx512::w8a8_rows, &avx512::prefill_attention},
    {Isa::kAvx512Bf16, &avx512::gemv_f32, &avx512_bf16::gemv_bf16, &avx512_bf16::paged_decode,
     &avx512_bf16::qgemv_rows, &avx512_bf16::w8a8_rows, &avx512_bf16::prefill_attention},
    {Isa::kAmx, &avx512::gemv_f32, &amx::gemv_bf16, &avx512_bf16::paged_decode, &avx512_bf16::qgemv_rows,
     &avx512_bf16::w8a8_rows, &avx512_bf16::prefill_attention},
};

#if defined(__x86_64__)
struct CpuId {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

CpuId cpuid(unsigned leaf, unsigned sub) {
  CpuId r;
  if (!__get_cpuid_count(leaf, sub, &r.a, &r.b, &r.c, &r.d)) return {};
  return r;
}

bool bit(unsigned reg, int i) { return (reg >> i) & 1u; }

unsigned long long xgetbv0() {
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

// Linux keeps AMX's 8 KiB of tile state off until a process asks (ARCH_REQ_XCOMP_PERM for XTILEDATA)
bool amx_permitted() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

Isa detect() {
  const CpuId l1 = cpuid(1, 0), l7 = cpuid(7, 0), l7s1 = cpuid(7, 1);
  if (!bit(l1.c, 27)) return Isa::kPortable;  // no OSXSAVE: the OS saves no vector state we can ask about
  const unsigned long long xcr0 = xgetbv0();
  const bool ymm = (xcr0 & 0x6) == 0x6, zmm = (xcr0 & 0xe6) == 0xe6, tiles = (xcr0 & 0x60000) == 0x60000;
  if (!(ymm && bit(l7.b, 5) && bit(l1.c, 12) && bit(l1.c, 29))) return Isa::kPortable;  // AVX2, FMA, F16C
  // AVX-512 F, DQ, BW, VL
  if (!(zmm && bit(l7.b, 16) && bit(l7.b, 17) && bit(l7.b, 30) && bit(l7.b, 31))) return Isa::kAvx2;
  if (!(bit(l7s1.a, 5) && bit(l7.c, 11))) return Isa::kAvx512;  // AVX512-BF16, AVX512-VNNI
  // AMX-BF16, AMX-TILE, AMX-INT8
  if (!(tiles && bit(l7.d, 22) && bit(l7.d, 24) && bit(l7.d, 25) && amx_permitted())) return Isa::kAvx512Bf16;
  return Isa::kAmx;
}
#else
Isa detect() { return Isa::kPortable; }
#endif

const Isa kBest = detect();
std::atomic<int> active{static_cast<int>(kBest)};

Isa parse(const std::string& name) {
  for (size_t i = 0; i < kNames.size(); ++i)
    if (name == kNames[i]) return static_cast<Isa>(i);
  TORCH_CHECK(false, "unknown instruction-set level '", name, "' (portable, avx2, avx512, avx512_bf16, amx)");
}

}  // namespace

const char* isa_name(Isa isa) { return kNames[static_cast<size_t>(isa)]; }

const KernelTable& active_kernels() { return kTables[active.load(std::memory_order_relaxed)]; }

bool isa_supported(const std::string& name) { return parse(name) <= kBest; }

// The level the kernels run at from now on; one the CPU cannot run is refused, never run.
void set_isa(const std::string& name) {
  const Isa isa = parse(name);
  TORCH_CHECK(isa <= kBest, "this CPU runs the CPU kernels up to '", isa_name(kBest), "', not '", name, "'");
  active.store(static_cast<int>(isa), std::memory_order_relaxed);
}

std::string best_isa() { return isa_name(kBest); }
std::string active_isa() { return isa_name(active_kernels().isa); }

// Turns steal_for.h's taking on or off for every kernel that splits its work through it; the setting it replaced
bool work_stealing(bool on) { return steal_on.exchange(on); }

TORCH_LIBRARY_FRAGMENT(baton_cpu, m) {
  m.def("isa_supported(str name) -> bool", &isa_supported);
  m.def("set_isa(str name) -> ()", &set_isa);
  m.def("best_isa() -> str", &best_isa);
  m.def("active_isa() -> str", &active_isa);
  m.def("work_stealing(bool on) -> bool", &work_stealing);
}
