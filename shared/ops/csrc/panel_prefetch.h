// A decode batch's later passes over a weight panel prefetch the thread's next panel into L2 (w8a8_impl.h,
// gemv_bf16_impl.h below the amx level): only the first pass reads a panel from DRAM, and the bus idled
// through the others (bench/next_panel_prefetch.py).
// No `#pragma once`: each kernel's *_impl.h includes it inside each level's namespace (isa_variants.h).
// Needs <algorithm> and <cstdint>, which the kernel's .cpp includes first.

// Lines of another panel a pass prefetches beside its own work
struct PanelPrefetch {
  const char* from = nullptr;
  int64_t lines = 0;
};

// Pass `pass` (0 the first) of `passes` over a panel of `panel_bytes`: its share of the next panel (at `next`;
// nullptr at the thread's last), at most `max_lines`. The first pass streams its own panel and takes none.
static inline PanelPrefetch next_panel_share(const void* next, int64_t panel_bytes, int64_t pass, int64_t passes,
                                             int64_t max_lines) {
  if (next == nullptr || pass == 0 || pass >= passes) return {};
  const int64_t lines = (panel_bytes + 63) / 64, later = passes - 1;
  const int64_t first = lines * (pass - 1) / later;
  return {static_cast<const char*>(next) + 64 * first, std::min(lines * pass / later - first, max_lines)};
}

// Prefetches the share's lines up to the fraction done / total of the pass; `line` is the next one to issue.
// Called at a block's or chunk's start, never in the innermost loop (a branch there slowed every W8A8 pass
// by 1.4x).
static inline void prefetch_share_upto(const PanelPrefetch& share, int64_t& line, int64_t done, int64_t total) {
  for (const int64_t upto = share.lines * done / total; line < upto; ++line)
    __builtin_prefetch(share.from + 64 * line, 0, 2);
}
