"""Corrupted outputs: every directory output of the pipeline carries a files.json (sha256 and size of
each file), and its reader checks it before using anything. One table of the outputs (the real ones
of the shared `pipeline_run`) drives one set of damages — a listed file truncated, one bit flipped
in any listed file, a listed file deleted, an unlisted file added, files.json missing, truncated, or
listing a path outside the directory — and each must be refused by the reader's own check with its
error type, naming the damaged file (or files.json) and the fix; never a pyarrow, safetensors or
torch error from deep inside a loader, never silently wrong numbers. An intact output passes.

The manifest's semantic checks (counts that do not add up, a summary.json that misdescribes the
shards) are reached only past files.json, so those tests re-list the directory after editing it:
they model a writer bug, not disk damage."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflashpipe.compile.artifact import CompileArtifactError, verify_artifact
from dflashpipe.core.artifacts import FILE_LISTING, canonical_json, write_file_listing
from dflashpipe.core.errors import SourceError
from dflashpipe.core.pipeline import COMPILE, DRAFTER, MANIFEST, TOKENS, TRAIN_STATE
from dflashpipe.data.shards import EVAL_FILE, SUMMARY_FILE, read_manifest_shard, verify_manifest
from dflashpipe.evaluate.evaluation import verify_drafter
from dflashpipe.evaluate.prompts import read_eval_split
from dflashpipe.tokens.shards import load_tokens
from dflashpipe.train.checkpoint import CHECKPOINT, TrainCheckpointError, verify_checkpoint


@dataclass(frozen=True)
class Output:
    """A directory output as one of its readers sees it."""

    name: str
    path: Path
    """Where the pipeline writes it, under the project."""
    check: Callable[[Path], object]
    """The reader's check, given the directory: what runs before anything of it is used."""
    error: type[Exception]
    fix: tuple[str, ...]
    """What a refusal must tell the user to run ({dir}: the directory)."""
    only: tuple[str, ...] | None = None
    """The files the reader depends on, when not the whole directory."""

    def checked(self, directory: Path) -> list[str]:
        """The listed files this reader checks, in files.json's order."""
        return [f for f in json.loads((directory / FILE_LISTING).read_text()) if self.only is None or f in self.only]

    def fixes(self, directory: Path) -> list[str]:
        return [f.format(dir=directory) for f in self.fix]


OUTPUTS = [
    Output("manifest", MANIFEST, verify_manifest, SourceError, ("`dvc checkout {dir}`", "`dvc repro -f manifest`")),
    Output(
        "eval split",
        MANIFEST,
        read_eval_split,
        SourceError,
        ("`dvc checkout {dir}`", "`dvc repro -f manifest`"),
        only=(EVAL_FILE,),
    ),
    Output("tokens", TOKENS, load_tokens, SourceError, ("`dvc checkout {dir}`", "`dvc repro -f tokenize`")),
    Output(
        "compile artifact",
        COMPILE,
        verify_artifact,
        CompileArtifactError,
        ("`dvc checkout {dir}`", "`dvc repro -f warmup`"),
    ),
    Output("drafter", DRAFTER, verify_drafter, SourceError, ("`dvc checkout {dir}`", "`dvc repro -f train`")),
    Output("checkpoint", TRAIN_STATE / CHECKPOINT, verify_checkpoint, TrainCheckpointError, ("`rm -r {dir}`",)),
]
each_output = pytest.mark.parametrize("output", OUTPUTS, ids=[o.name for o in OUTPUTS])


def copy_output(pipeline_run: Path, output: Output, to: Path) -> Path:
    directory = to / output.name.replace(" ", "-") / output.path.name
    shutil.copytree(pipeline_run / output.path, directory)
    return directory


@pytest.fixture(scope="module")
def pristine(pipeline_run, tmp_path_factory) -> dict[str, Path]:
    """A copy of every output, for tests that change a file and restore it (hypothesis runs many examples)."""
    root = tmp_path_factory.mktemp("pristine")
    return {o.name: copy_output(pipeline_run, o, root) for o in OUTPUTS}


def refused(output: Output, directory: Path, prefix: str) -> None:
    """The reader's check refuses `directory` with its error type: `prefix` (the damaged file and what is
    wrong with it) first, the fix after it."""
    with pytest.raises(output.error) as err:
        output.check(directory)
    message = str(err.value)
    assert message.startswith(prefix), f"expected {prefix!r}...\n     got {message!r}"
    for fix in output.fixes(directory):
        assert fix in message, f"{fix} not in {message!r}"


@each_output
def test_an_intact_output_passes_its_reader(pristine, output):
    output.check(pristine[output.name])


def test_an_intact_manifest_reads_back(pristine):
    manifest = pristine["manifest"]
    summary = verify_manifest(manifest)
    assert [read_manifest_shard(manifest, e).num_rows for e in [summary["eval"], *summary["shards"]]] == [
        e["samples"] for e in [summary["eval"], *summary["shards"]]
    ]
    assert len(read_eval_split(manifest)) == summary["eval"]["samples"]


DAMAGES = ["truncated", "deleted", "extra file", "no files.json", "files.json truncated", "files.json escapes"]


@pytest.mark.parametrize("damage", DAMAGES)
@each_output
def test_a_damaged_output_is_refused_naming_the_file_and_the_fix(pipeline_run, tmp_path, output, damage):
    directory = copy_output(pipeline_run, output, tmp_path)
    listing = directory / FILE_LISTING
    checked = output.checked(directory)
    victim = max(checked, key=lambda f: ((directory / f).stat().st_size, f))  # the biggest file the reader reads
    path = directory / victim
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        refused(
            output, directory, f"{path}: does not match its sha256 in {listing} (truncated, bit-flipped or edited): "
        )
    elif damage == "deleted":
        path.unlink()
        refused(output, directory, f"{path}: listed in {listing} but missing: ")
    elif damage == "extra file":
        extra = f"{victim}.orig"
        shutil.copy(path, directory / extra)
        if output.only is None:
            refused(output, directory, f"{directory}: holds files that {listing} does not list ({extra}): ")
        else:  # the reader depends on its own files only: an unrelated file is no reason to refuse them
            assert extra not in output.only
            output.check(directory)
    elif damage == "no files.json":
        listing.unlink()
        refused(output, directory, f"{directory}: {FILE_LISTING} missing (not a complete output): ")
    elif damage == "files.json truncated":
        listing.write_bytes(listing.read_bytes()[: listing.stat().st_size // 2])
        refused(output, directory, f"{listing}: unreadable (")
    else:
        # The listing vouches for the victim at a path outside the directory, where an identical copy
        # lies: only the containment check can refuse it (size and sha256 match there).
        outside = directory.parent / victim
        outside.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, outside)
        files = json.loads(listing.read_text())
        files[f"../{victim}"] = files.pop(victim)
        listing.write_bytes(canonical_json(files))
        if output.only is None:
            refused(output, directory, f"{listing}: lists '../{victim}', a path outside {directory}: ")
        else:
            refused(output, directory, f"{listing}: does not list {victim}: ")


@contextlib.contextmanager
def one_bit_flipped(path: Path, data) -> Iterator[bytes]:
    """`path` with one bit, chosen by hypothesis, flipped for the duration; yields the original bytes."""
    original = path.read_bytes()
    offset = data.draw(st.integers(0, len(original) - 1), label="byte")
    flipped = bytearray(original)
    flipped[offset] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    path.write_bytes(bytes(flipped))
    try:
        yield original
    finally:
        path.write_bytes(original)


@each_output
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_any_bit_flipped_in_any_listed_file_is_refused(pristine, output, data):
    directory = pristine[output.name]
    path = directory / data.draw(st.sampled_from(output.checked(directory)), label="file")
    with one_bit_flipped(path, data):
        refused(
            output,
            directory,
            f"{path}: does not match its sha256 in {directory / FILE_LISTING} (truncated, bit-flipped or edited): ",
        )


# -- the manifest's own checks, past files.json: a writer that lists what it got wrong --

FIX = r"restore it with `dvc checkout .*` or rebuild it with `dvc repro -f manifest`"


@pytest.fixture
def manifest(pipeline_run, tmp_path) -> Path:
    return copy_output(pipeline_run, OUTPUTS[0], tmp_path)


def summary_of(manifest: Path) -> dict:
    return json.loads((manifest / SUMMARY_FILE).read_text())


def relisted(manifest: Path) -> Path:
    """files.json rewritten over what is there now: the write of a buggy writer, which files.json cannot catch."""
    write_file_listing(manifest)
    return manifest


def refused_manifest(manifest: Path, match: str) -> None:
    with pytest.raises(SourceError, match=match) as err:
        verify_manifest(manifest)
    assert f"`dvc checkout {manifest}`" in str(err.value) and "`dvc repro -f manifest`" in str(err.value)


def first_source(summary: dict) -> dict:
    return next(iter(summary["sources"].values()))


def add_skips(summary: dict) -> None:
    skipped = first_source(summary)["skipped"]
    skipped["no_turns"] = skipped.get("no_turns", 0) + 5


@pytest.mark.parametrize(
    ("name", "change", "match"),
    [
        (
            "a shard's sha256",
            lambda s: s["shards"][0].update(sha256="0" * 64),
            r"gives train-sharegpt-00000.parquet the sha256 000000000000\.\.\., but the file's is",
        ),
        (
            "a shard's row count",
            lambda s: s["shards"][2].update(samples=s["shards"][2]["samples"] + 1),
            r"counts do not add up",
        ),
        ("num_samples", lambda s: s.update(num_samples=s["num_samples"] + 1), r"counts do not add up"),
        ("a source's read count", lambda s: first_source(s).update(read=999), r"source '\w+': read 999"),
        ("a skip count", add_skips, r"source '\w+'"),
        ("an eval count", lambda s: first_source(s).update(eval=first_source(s)["eval"] + 1), r"counts do not add up"),
        (
            "a shard file escaping the directory",
            lambda s: s["shards"][0].update(file="../../etc/passwd"),
            r"not a manifest summary \(file '../../etc/passwd' is not a plain file name\)",
        ),
        ("the shard list", lambda s: s.update(shards={"file": "x"}), r"not a manifest summary"),
        ("an entry's type", lambda s: s["shards"][1].update(samples="10"), r"not a manifest summary"),
    ],
)
def test_a_summary_whose_numbers_do_not_add_up_is_refused(manifest, name, change, match):
    summary = summary_of(manifest)
    change(summary)
    (manifest / SUMMARY_FILE).write_bytes(canonical_json(summary))
    refused_manifest(relisted(manifest), rf"{manifest / SUMMARY_FILE}: .*{match}")


@pytest.mark.parametrize(
    ("name", "contents", "match"),
    [
        ("missing", None, r"summary.json not found"),
        ("not JSON", b'{"num_samples": 30, "shards": [', r"summary.json: not valid JSON .*truncated or edited"),
        ("a list", b"[]", r"summary.json: not a manifest summary \(a JSON list\)"),
    ],
)
def test_a_summary_that_is_no_summary_is_refused(manifest, name, contents, match):
    path = manifest / SUMMARY_FILE
    if contents is None:
        path.unlink()
    else:
        path.write_bytes(contents)
    refused_manifest(relisted(manifest), rf"{manifest}/{match}")


def test_a_summary_listing_files_that_are_not_there_is_refused(manifest):
    (manifest / "train-sharegpt-00001.parquet").unlink()
    refused_manifest(
        relisted(manifest),
        rf"{manifest / SUMMARY_FILE}: lists \['train-sharegpt-00001.parquet'\] "
        r"but the directory holds \[\]",
    )
    shutil.copy(manifest / "train-sharegpt-00000.parquet", manifest / "train-sharegpt-00001.parquet")
    shutil.copy(manifest / "train-sharegpt-00000.parquet", manifest / "train-sharegpt-99999.parquet")
    refused_manifest(
        relisted(manifest),
        rf"{manifest / SUMMARY_FILE}: lists \[\] "
        r"but the directory holds \['train-sharegpt-99999.parquet'\]",
    )


def test_a_shard_that_matches_its_hash_but_is_not_parquet_is_a_clear_error(manifest):
    # A listing written over a damaged file (hash and file agree) still never reaches pyarrow's traceback.
    path = manifest / "train-sharegpt-00000.parquet"
    path.write_bytes(b"PAR1 not really a parquet file")
    relisted(manifest)
    with pytest.raises(SourceError, match=rf"{path}: not a readable parquet shard .*{FIX}"):
        read_manifest_shard(manifest, summary_of(manifest)["shards"][0])
