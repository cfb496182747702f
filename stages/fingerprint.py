"""Stage `fingerprint`: observe the machine into data/env/fingerprint.json (always runs).

torch's ~12K installed files are checked against its RECORD; the hash state under .dvc/tmp lets a
rerun re-hash only the files whose size or mtime moved. The JSON is the same either way. The stage always
imports torch for the facts only it tells, and records them (LOADED_STATE) for `dflashpipe explain`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.core.artifacts import write_json_atomic  # noqa: E402
from dflashpipe.core.env import HASH_STATE, LOADED_STATE, observe  # noqa: E402
from dflashpipe.core.stage import run_stage  # noqa: E402


def _write(params) -> None:
    seen = observe(HASH_STATE, LOADED_STATE, project=".")  # DVC runs a stage in the project root
    integrity = seen.integrity
    write_json_atomic("data/env/fingerprint.json", seen.facts)
    kind = "full check" if integrity.full else "only files whose size/mtime moved"
    print(f"fingerprint: re-hashed {integrity.rehashed} of {integrity.checked} torch files ({kind})", file=sys.stderr)


if __name__ == "__main__":
    run_stage("fingerprint", _write)
