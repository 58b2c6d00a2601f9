// The row loop of a projection kernel that may end in silu(gate) * up (w8a8_impl.h, gemv_bf16_impl.h below
// the amx level): one step of the weight's panels over rows [m0, m1) in passes of R rows.
// No `#pragma once`: each kernel's *_impl.h includes it inside each level's namespace (isa_variants.h), so
// the passes it calls inline at the level's instructions.
// Needs <algorithm> and <cstdint>, and cpu_isa.h's SiluColsFn, which the kernel's .cpp includes first.

// Without `silu`, step p is panel p: pass(p, m, rest, dst, ldd, ncols) writes rows [m, m + rest) of its
// outputs into y [M, N]. With `silu` the weight is a gate_up projection (gate outputs [0, N / 2), up
// [N / 2, N), N / 2 a whole number of panels): step p runs gate panel p and up panel p + steps into `out`
// (two [R][kLanes] buffers on the caller's stack) and y [M, N / 2] gets silu(gate) * up through `silu`
// (silu_mul's own form), so the [M, N] projection is never written nor read back.
template <int64_t R, int64_t kLanes, typename Pass>
static inline void gated_rows(int64_t m0, int64_t m1, int64_t p, int64_t steps, int64_t N, float* y,
                              SiluColsFn silu, float (*out)[R * kLanes], const Pass& pass) {
  const int64_t I = N / 2;
  for (int64_t m = m0; m < m1; m += R) {
    const int64_t rest = std::min<int64_t>(R, m1 - m);
    if (!silu) {
      pass(p, m, rest, y + m * N + p * kLanes, N, std::min(kLanes, N - p * kLanes));
      continue;
    }
    pass(p, m, rest, out[0], kLanes, kLanes);
    pass(p + steps, m, rest, out[1], kLanes, kLanes);
    for (int64_t r = 0; r < rest; ++r)
      silu(out[0] + r * kLanes, out[1] + r * kLanes, y + (m + r) * I + p * kLanes, p * kLanes, kLanes, I);
  }
}
