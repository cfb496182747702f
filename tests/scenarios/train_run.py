"""Run the train stage's function on prepared inputs, in a process of its own (or under torchrun).

    python tests/scenarios/train_run.py WORKDIR CONFIG_JSON

WORKDIR holds tokens/, target/ and compile/; outputs go to WORKDIR/<name>/.

Outside a DVC project there is no dvc.yaml entry to key a run by, so the run's key is its config less
what pipeline.REUSE leaves out of train's key (the run's length, the cadences): the same config resumes
its own checkpoint, a longer one continues it, another does not. CONFIG_JSON may also hold
- "key_inputs": extra inputs of the key, as `reuse_key` names them (e.g. {"dep:src/x.py": "edited"}),
  to stand for an edited dvc.yaml dep;
- "compile_key_root": a DVC project whose warmup built WORKDIR/compile; the artifact is used only
  if it was built for that project's warmup key as it is now (absent: no key, compile cold);
- "features_dir": the features stage's output, read when the config's "features" mode is offline;
- "warmup_micro_batch": the main thread warms each replica's step at this micro_batch instead of the run's,
  as a warmup compiled for other shapes would leave it (a worker then meets a shape nothing compiled).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from dflashpipe.core.params import (  # noqa: E402
    CompileParams,
    FeaturesParams,
    ModelParams,
    TopologyParams,
    TrainParams,
    build,
)
from dflashpipe.core.pipeline import REUSE, StageKey, reuse_key  # noqa: E402
from dflashpipe.train.loop import TrainInputs  # noqa: E402
from dflashpipe.train.stage import TrainPaths, train_drafter  # noqa: E402

OPTIONS = ("key_inputs", "compile_key_root", "features_dir", "warmup_micro_batch")


def main(workdir: Path, config: dict) -> None:
    if "warmup_micro_batch" in config:
        import dflashpipe.train.loop as loop

        warm, rows = loop.run_step_once, config["warmup_micro_batch"]
        loop.run_step_once = lambda step_fn, drafter, model, _rows, device: warm(step_fn, drafter, model, rows, device)
    inputs = TrainInputs(
        model=build(ModelParams, config["model"], "model"),
        compile=build(CompileParams, config["compile"], "compile"),
        topology=build(TopologyParams, config["topology"], "topology"),
        train=build(TrainParams, config["train"], "train"),
        features=build(FeaturesParams, config.get("features", {"mode": "online"}), "features"),
    )
    out = workdir / config["name"]
    paths = TrainPaths(
        workdir / "tokens",
        workdir / "target",
        workdir / "compile",
        out / "drafter",
        out / "state",
        out / "metrics",
        Path(config["features_dir"]) if "features_dir" in config else None,
    )
    run_config = {k: v for k, v in config.items() if k not in OPTIONS}
    for name in REUSE["train"].without_params:
        section, key_name = name.split(".")
        run_config[section] = {k: v for k, v in run_config.get(section, {}).items() if k != key_name}
    key = StageKey("train", {"scenario:config": json.dumps(run_config, sort_keys=True), **config.get("key_inputs", {})})
    compile_key = reuse_key("warmup", config["compile_key_root"]) if "compile_key_root" in config else None
    metrics = train_drafter(inputs, paths, key, compile_key)
    print("METRICS " + json.dumps(metrics))


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
