"""What a server reads of a drafter, written in one place: the served check serves it, `dflashpipe export` hands it on.

An engine reads two files of a drafter directory (`SERVED_FILES`). model.safetensors goes as train wrote it.
config.json gets `dflash_config.mask_token`, the mask token as the target's tokenizer spells it (train writes it
only for a token it added past the tokenizer, in a spare embedding row). SGLang reads a mask token string beside
`mask_token_id` (by its source, `parse_dflash_draft_config`): absent, it assumes `<|MASK|>`, and refuses a config
whose id differs from the id the target's tokenizer has for that string; with ours spelled out, the two always
name one token. vLLM and the reference implementation read the id alone. Nothing else of the directory (the card,
files.json) is read by either.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dflashpipe.core.artifacts import write_json_atomic
from dflashpipe.core.errors import SourceError

SERVED_FILES = ("config.json", "model.safetensors")


def mask_token(target_dir: Path, token_id: int, added: str | None = None) -> str:
    """The mask token's string in the target's tokenizer (its tokenizer.json); `added`, the string training gave
    a spare embedding row past the tokenizer (`dflash_config.mask_token`), where the tokenizer has no such id."""
    from tokenizers import Tokenizer

    path = Path(target_dir) / "tokenizer.json"
    try:
        token = Tokenizer.from_file(str(path)).id_to_token(token_id)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own Exception type
        raise SourceError(f"{path}: not readable ({exc}): run `dvc repro target`") from None
    if token is None and added is not None:
        return added
    if token is None:
        raise SourceError(f"{path}: no token with id {token_id} (the drafter's mask_token_id): another target?")
    return token


def write_served_files(drafter_dir: Path | str, target_dir: Path | str, out: Path | str) -> Path:
    """SERVED_FILES of `drafter_dir` into `out` (which must exist), config.json with the mask token spelled out."""
    drafter_dir, out = Path(drafter_dir), Path(out)
    config = json.loads((drafter_dir / "config.json").read_text(encoding="utf-8"))
    dflash = config["dflash_config"]
    dflash["mask_token"] = mask_token(Path(target_dir), int(dflash["mask_token_id"]), dflash.get("mask_token"))
    write_json_atomic(out / "config.json", config)
    shutil.copyfile(drafter_dir / "model.safetensors", out / "model.safetensors")
    return out
