"""What every stage and command shares, below all of them: the stage shell, params and the pipeline model, atomic
writes, errors, the fingerprint, the thread budget, and the small shared rules (spread, incremental shards, kernels,
plots, headline figures).

Nothing here imports a stage's package or a command; this file re-exports nothing, so each module is imported by
its full name and a stage's dvc.yaml deps name exactly the shared modules it runs."""
