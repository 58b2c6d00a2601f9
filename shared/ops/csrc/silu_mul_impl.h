// silu(gate) * up's rows, compiled once per vector form (silu_mul_cpu.cpp): kVec floats a vector, and
// silu_mul_vec one vector of them; kVec 0 computes every element the scalar way.

// gate_up rows [r0, r1) of [rows, 2 * I] (row stride ld) -> out rows of [rows, I]
static void silu_rows(const float* in, int64_t ld, float* op, int64_t I, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = in + r * ld;
    const float* u = g + I;
    float* o = op + r * I;
    int64_t j = 0;
    if constexpr (kVec > 0) {
      for (; j + 2 * kVec <= I; j += 2 * kVec) {
        silu_mul_vec(g + j, u + j, o + j);
        silu_mul_vec(g + j + kVec, u + j + kVec, o + j + kVec);
      }
    }
    for (; j < I; ++j) o[j] = (g[j] / (1.f + std::exp(-g[j]))) * u[j];
  }
}

// Elements [j0, j0 + n) of one row (g, u, o point at element j0), each as silu_rows computes it: the vector
// form below I / (2 kVec) * 2 kVec, where silu_rows runs its vector chunks, the scalar form past it. Every
// operation is lane-wise, so an element's bits depend on its form, not on the other lanes of its vector:
// a GEMM's epilogue can take its own columns (j0 a multiple of kVec) and give silu_mul's bits.
static void silu_cols(const float* g, const float* u, float* o, int64_t j0, int64_t n, int64_t I) {
  int64_t j = 0;
  if constexpr (kVec > 0) {
    const int64_t vec_end = std::min<int64_t>(n, I / (2 * kVec) * (2 * kVec) - j0);
    for (; j + kVec <= vec_end; j += kVec) silu_mul_vec(g + j, u + j, o + j);
  }
  for (; j < n; ++j) o[j] = (g[j] / (1.f + std::exp(-g[j]))) * u[j];
}
