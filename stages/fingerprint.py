"""Stage `fingerprint`: observe the machine into data/env/fingerprint.json (always runs)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.artifacts import write_json_atomic  # noqa: E402
from dflashpipe.env import fingerprint  # noqa: E402
from dflashpipe.stage import run_stage  # noqa: E402

if __name__ == "__main__":
    run_stage("fingerprint", lambda params: write_json_atomic("data/env/fingerprint.json", fingerprint()))
