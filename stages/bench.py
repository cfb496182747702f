"""Stage `bench`: the drafter's training step alone, compiled vs eager, on synthetic inputs, into metrics/bench.json.

python stages/bench.py      (what dvc.yaml runs; it depends on kernels and shapes, never on data)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.bench.stage import run_bench  # noqa: E402
from dflashpipe.core.pipeline import BENCH_METRICS, COMPILE, TARGET, reuse_key  # noqa: E402
from dflashpipe.core.stage import run_stage  # noqa: E402
from dflashpipe.core.threads import training_budget  # noqa: E402


def bench(p) -> None:
    # warmup's key, as dvc.yaml defines it: the compiled step loads data/compile only if it was built for it
    compile_key = reuse_key("warmup") if p.compile.enabled else None
    # the step as train's drafter threads run it: at their intra-op count, which warmup compiled it at
    threads = training_budget(p.topology.target_devices, p.topology.drafter_devices)
    run_bench(
        p.model,
        p.compile,
        TARGET,
        COMPILE,
        BENCH_METRICS,
        compile_key,
        threads=threads,
        target_dtype=p.compute.target_dtype,
    )


if __name__ == "__main__":
    run_stage("bench", bench)
