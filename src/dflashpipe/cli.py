"""`dflashpipe`: the project's own commands beside `dvc`."""

from __future__ import annotations

import dataclasses
import json

import typer
from typer.core import TyperGroup

from dflashpipe.commands import explain as explaining
from dflashpipe.commands.rerun import verify as verifying
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.params import load_params, load_stage_params


class OneLineErrors(TyperGroup):
    """Every command's bad input (a DflashpipeError) as one line on stderr and exit code 2, never a traceback:
    said once here, so a new command gets it by being a command."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DflashpipeError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None


app = typer.Typer(cls=OneLineErrors, no_args_is_help=True, add_completion=False, help=__doc__)


@app.callback()
def main() -> None:
    """dflashpipe: train and measure a DFlash drafter as a DVC pipeline."""


@app.command()
def params(stage: str = typer.Option(None, help="Show only what this dvc.yaml stage may read.")) -> None:
    """Validate params.yaml (and its match with dvc.yaml) and print the typed values."""
    sections = load_stage_params(stage).sections if stage else load_params()
    typer.echo(json.dumps({k: dataclasses.asdict(v) for k, v in sections.items()}, indent=2))


@app.command()
def profile(
    file: str = typer.Argument(..., help="A profile: params.yaml's shape, only the keys it changes (profiles/)."),
    name: str = typer.Option(None, help="The experiment's name (default: the file's name)."),
) -> None:
    """Check a profile over params.yaml and print the `dvc exp run` line that applies it."""
    from dflashpipe.core.params.profile import experiment_command

    typer.echo(experiment_command(file, name))


SET_OPTION = typer.Option(None, "-S", "--set", help="section.key=value over those, as `dvc exp run -S`; repeatable.")


@app.command()
def plan(
    profile: str = typer.Argument(None, help="A profile laid over params.yaml (profiles/); none: params.yaml."),
    sets: list[str] = SET_OPTION,
    device: str = typer.Option(None, help="The GPU that the topology's cuda:N devices are (e.g. H100, H200)."),
    devices: str = typer.Option(None, help="A YAML file of more devices: NAME: {bf16_tflops, fp32_tflops, ...}."),
    target_config: str = typer.Option(None, help="The target's config.json (or a shipped one: qwen3-8b)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    out: str = typer.Option(None, "--out", help="Also record the plan, as JSON, in this file."),
    queue: bool = typer.Option(False, help="Then queue it as a DVC experiment (`dvc exp run --queue`)."),
    name: str = typer.Option(None, help="With --queue: the experiment's name."),
) -> None:
    """The run on paper: memory per device, each side's throughput and the split that balances them, the
    features' link or disk, the wall time, every figure with its source; refused when it cannot fit."""
    import subprocess

    from dflashpipe.commands.plan import make_plan, plan_json, plan_lines
    from dflashpipe.core.params.profile import experiment_words

    made = make_plan(profile, sets, device, devices, target_config)
    text = plan_json(made)
    if out:
        from dflashpipe.core.artifacts import write_bytes_atomic

        write_bytes_atomic(out, (text + "\n").encode())
    typer.echo(text if as_json else "\n".join(plan_lines(made)))
    if queue:
        words = experiment_words(made.run.overrides, name, queue=True)
        typer.echo(" ".join(words), err=True)
        raise typer.Exit(subprocess.run(words).returncode)


@app.command()
def rehearse(
    profile: str = typer.Argument(..., help="A GPU profile (profiles/) to run on this CPU, every stage of it."),
    target_config: str = typer.Option(None, help="The target's config.json (or a shipped one: qwen3-8b)."),
    keep: str = typer.Option(None, help="Keep the scratch project in this (new or empty) directory."),
) -> None:
    """Run a GPU profile's whole DAG on this CPU, on a small stand-in of its target, before a GPU is paid for;
    every departure from the profile is printed with why."""
    from dflashpipe.commands.rehearse import main_lines
    from dflashpipe.commands.rehearse import rehearse as run

    for line in main_lines(run(profile, ".", target_config, keep)):
        typer.echo(line)


@app.command()
def explain(
    a: str = typer.Argument("HEAD", help="The earlier state: a git revision, a DVC experiment, or 'workspace'."),
    b: str = typer.Argument(explaining.WORKSPACE, help="The later state (default: the workspace)."),
    since: str = typer.Option(None, help="Compare this revision against the workspace."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    as_md: bool = typer.Option(False, "--md", help="Markdown, for pasting into an issue or PR."),
    full: bool = typer.Option(
        False, "--all", help="After the answer: every stage's reason, every metric, the evidence."
    ),
    verify: str = typer.Option(
        None, help="A metric key: rerun the pipeline with each cause reaching it reverted alone to A, and measure."
    ),
    budget: int = typer.Option(None, min=0, help="With --verify: run at most this many interventions."),
    runs: int = typer.Option(3, min=1, help="With --verify: measured runs per arm, interleaved across arms."),
    own_stage: bool = typer.Option(
        False, "--full", help="With --verify: measure the metric's own stage, not its probe."
    ),
    time_budget: float = typer.Option(
        verifying.TIME_BUDGET_S, help="With --verify: refuse, before any run, a verification estimated to take longer."
    ),
) -> None:
    """What changed between two states, what it invalidated (and what not), what it cost."""
    if since:
        a, b = since, explaining.WORKSPACE
    result = (
        verifying.verify(verify, a, b, budget=budget, runs=runs, full=own_stage, time_budget=time_budget)
        if verify
        else explaining.explain(a, b)
    )
    if as_json:
        typer.echo(verifying.verification_json(result) if verify else explaining.to_json(result))
    elif as_md:
        typer.echo(
            verifying.verification_markdown(result) if verify else explaining.to_markdown(result, full), nl=False
        )
    elif verify:  # the first screen, the metric's causes ranked by what the arms measured; then the arms
        explaining.print_text(result.report, measured=verifying.measured_effects(result))
        typer.echo("\n" + "\n".join(verifying.verification_lines(result)))
    else:
        explaining.print_text(result, full)


METRIC_OPTION = typer.Option(None, help="A metric key (or file:key) to follow; repeatable.")


@app.command()
def history(
    since: str = typer.Option(None, help="Start after this revision (default: the first commit with a dvc.lock)."),
    metric: list[str] = METRIC_OPTION,
    workspace: bool = typer.Option(False, help="Also explain the workspace against HEAD (observes this machine)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    as_md: bool = typer.Option(False, "--md", help="Markdown, for pasting into an issue or PR."),
) -> None:
    """Every commit since a revision and its experiments: headline metrics, moves beyond noise, root causes."""
    from dflashpipe.commands.explain.history import history as walk
    from dflashpipe.commands.explain.history import history_lines, history_markdown

    found = walk(since, metric or None)
    live = explaining.explain("HEAD", explaining.WORKSPACE) if workspace else None
    if as_json:
        data = {**dataclasses.asdict(found), "workspace": live and dataclasses.asdict(live)}
        typer.echo(json.dumps(data, indent=2, default=str))
    elif as_md:
        typer.echo(history_markdown(found) + (f"\n{explaining.to_markdown(live)}" if live else ""), nl=False)
    else:
        typer.echo("\n".join(history_lines(found)))
        if live:
            explaining.print_text(live)


@app.command()
def bisect(
    metric: str = typer.Argument(..., help="The metric key (or file:key) that moved."),
    good: str = typer.Argument(..., help="A revision where it was as it should be."),
    bad: str = typer.Argument(..., help="A later revision on the same line where it had moved."),
    runs: int = typer.Option(1, help="Measurements per probe (the first may be the commit's own record)."),
) -> None:
    """The first commit between GOOD and BAD whose METRIC moved beyond noise, each probe reproduced with DVC
    in a temporary worktree sharing this project's cache (so only what the cache lacks is run)."""
    from dflashpipe.commands.rerun.bisect import bisect as search
    from dflashpipe.commands.rerun.bisect import bisect_lines

    found = search(metric, good, bad, runs)
    typer.echo("\n".join(bisect_lines(found)))


@app.command()
def report(
    out: str = typer.Option(None, "--out", help="Where to write (default report.html, or report.md with --md)."),
    as_md: bool = typer.Option(False, "--md", help="Markdown plus an images folder beside it, instead of HTML."),
) -> None:
    """One self-contained page for the current state: the DAG's verdicts, headline metrics, the per-benchmark
    table (printed here too), plots, explain."""
    from dflashpipe.commands.report.build import benchmark_table, write_report

    path = write_report(".", out, as_md)
    table = benchmark_table(".")
    if table is not None:
        typer.echo("\n".join(table.lines()))
    typer.echo(f"wrote {path}")


@app.command()
def export(out: str = typer.Argument(..., help="The directory to write the drafter to, for serving.")) -> None:
    """Write data/drafter as a server reads it (docs/serving.md), with a model card naming its git revision,
    dvc.lock and tau/speedup."""
    from dflashpipe.serve.export import export_drafter

    path = export_drafter(out)
    typer.echo(f"exported {path}")


@app.command("plots-template")
def plots_template(
    path: str = typer.Argument(..., help="Where to write it (bin/setup: .dvc/plots/offline.html)."),
) -> None:
    """Write the offline HTML template for `dvc plots show` / `dvc plots diff` (Vega inlined, no CDN).

    .dvc/config's plots.html_template points at it."""
    from dflashpipe.core import plots

    typer.echo(f"wrote {plots.write_template(path)}")
