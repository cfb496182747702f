"""Typed, validated parameters: params.yaml read once, checked against dvc.yaml.

Each top-level section of params.yaml is one concern with one dataclass. A stage
gets only the sections that its dvc.yaml entry declares, and the declared keys of
a section must be exactly that dataclass's fields: a stage can neither read a key
that DVC does not watch (a change would go unseen) nor declare one it never reads
(it would rerun for nothing).

`sections` declares the dataclasses (fields, docstrings, range checks); `loading`
reads params.yaml and dvc.yaml into them. `__all__` is the public API.
"""

from __future__ import annotations

from dflashpipe.core.params.loading import (
    DVC_FILE,
    PARAMS_FILE,
    StageParams,
    build,
    declared_keys,
    load_params,
    load_stage_params,
)
from dflashpipe.core.params.sections import (
    SECTIONS,
    USER_BENCHMARK_KINDS,
    USER_SOURCE_KINDS,
    BenchmarkSpec,
    CompileParams,
    ComputeParams,
    DataParams,
    EvaluateParams,
    FeaturesParams,
    GateParams,
    ModelParams,
    ServeParams,
    SourceSpec,
    TargetParams,
    TokenizeParams,
    TopologyParams,
    TrainParams,
)

__all__ = [
    "DVC_FILE",
    "PARAMS_FILE",
    "SECTIONS",
    "USER_BENCHMARK_KINDS",
    "USER_SOURCE_KINDS",
    "BenchmarkSpec",
    "CompileParams",
    "DataParams",
    "EvaluateParams",
    "FeaturesParams",
    "GateParams",
    "ModelParams",
    "ServeParams",
    "SourceSpec",
    "StageParams",
    "ComputeParams",
    "TargetParams",
    "TokenizeParams",
    "TopologyParams",
    "TrainParams",
    "build",
    "declared_keys",
    "load_params",
    "load_stage_params",
]
