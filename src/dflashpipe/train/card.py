"""The drafter's README.md: a model card generated from the run that wrote it.

Two cards, one generator:

- `data/drafter/README.md`, written by `train`, says what the drafter is for (the target),
  what it was trained on (the token counts), how (every train param) and what it is on disk
  (config keys, dtype, parameter count, read back from the files just written). It holds
  only what train's inputs decide, with no timestamps, so a rerun with the same inputs writes
  the same bytes: two clean clones of one commit (tests/reliability/test_deterministic.py),
  and a killed train resumed at a later commit (tests/reliability/test_killed.py).
  It cannot hold the git revision (the same inputs at a later commit would write other
  bytes), nor dvc.lock's hash (dvc.lock records data/drafter's own hash: a card holding it
  changes with every rerun, and the lock with it), nor tau and the speedup (`evaluate` runs
  after train and writes into no other stage's output).
- `export` (`dflashpipe export OUT`), run after `dvc repro`, copies the drafter
  to OUT with those sections filled in: the git revision and whether the workspace differed
  from it, dvc.lock's sha256 (which records this drafter's md5), and tau/speedup with their
  setup from metrics/eval.json.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import yaml

from dflashpipe.core.artifacts import file_sha256
from dflashpipe.core.revision import run_git

CARD_FILE = "README.md"
LOCK_FILE = "dvc.lock"
UNKNOWN = "unknown"
HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""A Hugging Face `owner/name`: only such a target source goes into the card's `base_model`."""
# What `dvc repro` itself rewrites while it runs: a change there is no change to the code.
NOT_DIRTY = (":(exclude)dvc.lock", ":(exclude)metrics", ":(exclude,glob)**/.gitignore")


def _git(root: Path, *args: str) -> str | None:
    """git's answer through the one revision reader; None off a repository or without git."""
    try:
        proc = run_git(root, *args)
    except OSError:  # no git on this machine
        return None
    return proc.stdout.decode() if proc.returncode == 0 else None


def provenance(root: Path | None) -> dict[str, Any]:
    """git revision, whether tracked files differ from it, and dvc.lock's sha256 now; UNKNOWN/None off a project."""
    if root is None:
        return {"revision": UNKNOWN, "dirty": None, "dvc_lock_sha256": None}
    head = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *NOT_DIRTY) if head else None
    lock = root / LOCK_FILE
    return {
        "revision": head.strip() if head else UNKNOWN,
        "dirty": bool(status.strip()) if status is not None else None,
        "dvc_lock_sha256": file_sha256(lock) if lock.is_file() else None,
    }


def safetensors_summary(path: Path | str) -> dict[str, Any]:
    """dtypes and parameter count from a safetensors file's header (nothing else is read)."""
    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    count = 0
    for entry in tensors.values():
        n = 1
        for dim in entry["shape"]:
            n *= dim
        count += n
    return {"dtypes": sorted({v["dtype"] for v in tensors.values()}), "parameters": count, "tensors": len(tensors)}


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _yaml(obj: Any) -> str:
    # through JSON: tuples become lists, which safe_dump writes
    return yaml.safe_dump(json.loads(json.dumps(obj)), sort_keys=False, default_flow_style=None).rstrip()


def model_card(
    *,
    config: dict[str, Any],
    weights: dict[str, Any],
    target: dict[str, Any],
    tokens: dict[str, Any],
    params: dict[str, Any],
    origin: dict[str, Any] | None = None,
    evaluation: dict[str, Any] | None = None,
) -> str:
    """The card's text from config.json, the weights' summary, the target's source.json, the tokens'
    summary.json and train's params; `origin` (provenance()) and `evaluation` (metrics/eval.json)
    only in an export (None: the section says where to find them)."""
    dflash = config.get("dflash_config", {})
    block_size = config.get("block_size", dflash.get("block_size"))
    source = str(target.get("source", UNKNOWN))
    front = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["dflash", "speculative-decoding", "draft-model", "dflashpipe"],
    }
    if HF_REPO_ID.match(source):
        front["base_model"] = source
    per_source = tokens.get("sources") or {}
    data_rows = "\n".join(
        "| "
        + " | ".join([name, *(str(c.get(k, UNKNOWN)) for k in ("samples_out", "tokens", "supervised_tokens"))])
        + " |"
        for name, c in sorted(per_source.items())
    )
    spec_tokens = block_size - 1 if isinstance(block_size, int) else "BLOCK_SIZE - 1"
    served = _served_as_trained(tokens, params)
    lines = [
        "---",
        _yaml(front),
        "---",
        "",
        f"# DFlash drafter for `{source}`",
        "",
        "A [DFlash](https://github.com/z-lab/dflash) block-diffusion drafter for speculative decoding, trained",
        "by dflashpipe (`dvc repro train`). It has no embedding and no LM head of its own:",
        "it borrows the target's, so it only works with the target below.",
        "",
        "## Target",
        "",
        f"- source: `{source}` (sha256 `{target.get('source_sha256', UNKNOWN)}`)",
        f"- model type: `{target.get('model_type', UNKNOWN)}`, {target.get('num_hidden_layers', UNKNOWN)} layers, "
        f"hidden size {target.get('hidden_size', UNKNOWN)}, vocabulary {target.get('vocab_size', UNKNOWN)}, "
        f"{target.get('num_parameters', UNKNOWN)} parameters, materialised as `{target.get('dtype', UNKNOWN)}`",
        "",
        "## Drafter",
        "",
        f"- `{config.get('architectures', [UNKNOWN])[0]}`: {config.get('num_hidden_layers')} Qwen3 decoder layers "
        f"(non-causal), {weights['parameters']} parameters, weights `{', '.join(weights['dtypes'])}` "
        f"(config.json `torch_dtype`: `{config.get('torch_dtype', config.get('dtype'))}`)",
        f"- block size {block_size} (the anchor + {spec_tokens} drafted tokens)",
        f"- target layers read: {dflash.get('target_layer_ids')} (of {config.get('num_target_layers')})",
        f"- mask token id: {dflash.get('mask_token_id', config.get('mask_token_id'))}",
        "",
        "## Training data",
        "",
        f"{tokens.get('samples_out', UNKNOWN)} samples, {tokens.get('tokens', UNKNOWN)} tokens "
        f"({tokens.get('supervised_tokens', UNKNOWN)} supervised), rendered with the target's chat template.",
        "",
        "| source | samples | tokens | supervised tokens |",
        "|---|---|---|---|",
        data_rows or "| (no per-source counts) | | | |",
        "",
        "## Training parameters",
        "",
        "```yaml",
        _yaml(params),
        "```",
        "",
        *_evaluation_lines(evaluation),
        *_provenance_lines(origin),
        "## Use",
        "",
        "Reference implementation (`pip install dflash`):",
        "",
        "```python",
        "from dflash.model import DFlashDraftModel",
        'drafter = DFlashDraftModel.from_pretrained("path/to/this/directory", dtype="auto")',
        "```",
        "",
        "Serving (docs/serving.md in dflashpipe): vLLM as dflashpipe's served check runs it (`method` named: vLLM",
        'infers it only from a path containing "dflash"; `num_speculative_tokens` = block size - 1: vLLM does not',
        "read `block_size`); SGLang's flags as its source reads them, not run by dflashpipe. Serve the directory",
        "`dflashpipe export` writes, with the exact target above:",
        "",
        "```bash",
        "python -m vllm.entrypoints.openai.api_server --model TARGET --speculative-config \\",
        "    '"
        + json.dumps({"method": "dflash", "model": "path/to/this/directory", "num_speculative_tokens": spec_tokens})
        + "'"
        + "".join(f" \\\n    {flag}" for flag in served),
        "python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH \\",
        f"    --speculative-draft-model-path path/to/this/directory --speculative-num-draft-tokens {block_size}",
        "```",
        "",
    ]
    return "\n".join(lines)


def _served_as_trained(tokens: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """vLLM's flags that serve the drafter as it was trained: the numerics it learnt in and the chat template's
    arguments its rows were rendered with (a Qwen3 served without `enable_thinking: false` thinks, and its drafter,
    trained on replies without thinking, drafts for another text)."""
    flags = []
    trained_in = (params.get("compute") or {}).get("trained_in")
    if trained_in:
        flags.append(f"--dtype {trained_in}")
    if tokens.get("chat_template_kwargs"):
        flags.append(f"--default-chat-template-kwargs '{json.dumps(tokens['chat_template_kwargs'], sort_keys=True)}'")
    return flags


def _evaluation_lines(evaluation: dict[str, Any] | None) -> list[str]:
    lines = ["## Evaluation", ""]
    if evaluation is None:
        return lines + [
            "Not in this card: `evaluate` runs after `train` and writes tau (mean tokens committed per",
            "draft-and-verify step) and the speedup over target-only greedy decoding, with their setup, to",
            "`metrics/eval.json` of the same revision (`dvc metrics show`). `dflashpipe export OUT`",
            "exports this drafter with them filled in.",
            "",
        ]
    setup = evaluation.get("setup", {})
    tps = evaluation.get("decode_tokens_per_s", {})
    return lines + [
        f"- tau (mean tokens committed per draft-and-verify step): {evaluation.get('tau', UNKNOWN)}",
        f"- speedup over target-only greedy decoding: {evaluation.get('speedup', UNKNOWN)}x "
        f"({tps.get('speculative', UNKNOWN)} vs {tps.get('target', UNKNOWN)} tokens/s)",
        f"- lossless (speculative output = the target's greedy output): {evaluation.get('lossless', UNKNOWN)}",
        "- setup: dflashpipe's own transformers decoder (not an engine), batch 1, "
        + ", ".join(f"{k} {v}" for k, v in sorted(setup.items())),
        "",
    ]


def _provenance_lines(origin: dict[str, Any] | None) -> list[str]:
    lines = ["## Provenance", ""]
    if origin is None:
        return lines + [
            "The commit whose dvc.lock lists this directory's md5 under `train` → `outs` → `data/drafter`",
            "(`git log -- dvc.lock`); `dflashpipe export OUT` exports this drafter with the git",
            "revision and dvc.lock's sha256 filled in.",
            "",
        ]
    dirty = {True: "yes (tracked files other than dvc.lock and metrics/ differed from it)", False: "no"}
    return lines + [
        f"- git revision: `{origin.get('revision', UNKNOWN)}`; workspace differed from it: "
        f"{dirty.get(origin.get('dirty'), UNKNOWN)}",
        f"- dvc.lock sha256: `{origin.get('dvc_lock_sha256') or 'none (no dvc.lock)'}`",
        "",
    ]


def write_model_card(
    drafter_dir: Path | str,
    *,
    target_dir: Path | str,
    tokens_dir: Path | str,
    params: dict[str, Any],
    origin: dict[str, Any] | None = None,
    evaluation: dict[str, Any] | None = None,
) -> None:
    """README.md in `drafter_dir`, beside the config.json and model.safetensors it describes."""
    from dflashpipe.core.artifacts import write_bytes_atomic

    drafter_dir = Path(drafter_dir)
    text = model_card(
        config=read_json(drafter_dir / "config.json"),
        weights=safetensors_summary(drafter_dir / "model.safetensors"),
        target=read_json(Path(target_dir) / "source.json"),
        tokens=read_json(Path(tokens_dir) / "summary.json"),
        params=params,
        origin=origin,
        evaluation=evaluation,
    )
    write_bytes_atomic(drafter_dir / CARD_FILE, text.encode("utf-8"))


def locked_train_params(root: Path) -> dict[str, Any]:
    """The params train ran with, as dvc.lock records them (section -> key -> value)."""
    lock = yaml.safe_load((root / LOCK_FILE).read_text(encoding="utf-8")) or {}
    flat = (lock.get("stages", {}).get("train", {}).get("params") or {}).get("params.yaml") or {}
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        section, _, name = key.partition(".")
        nested.setdefault(section, {})[name] = value
    return nested
