"""Run the train stage's function on prepared inputs, in a process of its own (or under torchrun).

    python tests/scenarios/train_run.py WORKDIR CONFIG_JSON

WORKDIR holds tokens/, target/ and compile/; outputs go to WORKDIR/<name>/.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from dflashpipe.params import CompileParams, ModelParams, TopologyParams, TrainParams, build  # noqa: E402
from dflashpipe.train.loop import TrainInputs, train_drafter  # noqa: E402


def main(workdir: Path, config: dict) -> None:
    inputs = TrainInputs(model=build(ModelParams, config["model"], "model"),
                         compile=build(CompileParams, config["compile"], "compile"),
                         topology=build(TopologyParams, config["topology"], "topology"),
                         train=build(TrainParams, config["train"], "train"))
    out = workdir / config["name"]
    metrics = train_drafter(inputs, workdir / "tokens", workdir / "target", workdir / "compile",
                            out / "drafter", out / "state", out / "metrics")
    print("METRICS " + json.dumps(metrics))


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
