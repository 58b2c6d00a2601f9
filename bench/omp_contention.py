"""Two processes' torch thread teams on one machine's cores: how much an oversubscribed OpenMP team loses.

The simulator (shared/planner/sim_engine.py `Host`) shares cores among engines as the OS shares them among
threads (processor sharing). A torch op split over an OpenMP team ends at a barrier, so a team whose threads
are time-sliced with another process's waits for its slowest thread. This measures it: each configuration
runs its processes at once for `--seconds`, each a loop of a prefill-sized pair of projections (128 rows of
SmolLM2-135M's 576 -> 1536 -> 576), and reports iterations per second against the same team alone.

    python -m bench.omp_contention [--seconds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.results_file import write_results

WORKER = """
import sys, time, torch
threads, secs = int(sys.argv[1]), float(sys.argv[2])
torch.set_num_threads(threads)
a, w, w2 = torch.randn(128, 576), torch.randn(576, 1536), torch.randn(1536, 576)
for _ in range(20):
    (a @ w) @ w2
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < secs:
    for _ in range(10):
        (a @ w) @ w2
    n += 10
print(n / (time.perf_counter() - t0))
"""


def run(teams: list[int], seconds: float) -> list[float]:
    """Iterations per second of each team, all started together."""
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(t), str(seconds)], stdout=subprocess.PIPE, text=True)
             for t in teams]
    return [float(p.communicate()[0]) for p in procs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    alone = {t: run([t], args.seconds)[0] for t in sorted({1, cores})}
    rows = []
    for teams in ([1, 1], [cores, 1], [cores, cores], [1, 1, 1]):
        rates = run(teams, args.seconds)
        threads = sum(teams)
        shared = min(1.0, cores / threads)  # processor sharing's prediction, as a share of alone
        rows.append({"teams": teams, "iters_per_s": [round(r, 1) for r in rates],
                     "of_alone": [round(r / alone[t], 3) for r, t in zip(rates, teams, strict=True)],
                     "processor_sharing": round(shared, 3)})
        print(f"teams {teams}: {[round(r / alone[t], 2) for r, t in zip(rates, teams, strict=True)]} of alone "
              f"(processor sharing: {shared:.2f})", file=sys.stderr)
    result = {"bench": "omp_contention", "cores": cores, "seconds": args.seconds,
              "alone_iters_per_s": {str(t): round(r, 1) for t, r in alone.items()}, "rows": rows,
              "loadavg_at_start": os.getloadavg(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path = write_results(result, args.out_dir, "omp_contention", record_name=True)
    print(json.dumps({"bench": "omp_contention", "file": path.name}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
