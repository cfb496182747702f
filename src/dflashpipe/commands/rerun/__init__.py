"""The commands that run the pipeline again to answer what records alone cannot: `explain --verify` (each
cause reverted alone, measured) and `bisect` (the first commit where a figure moved). `dflashpipe.commands.explain`
only reads; this package runs, and both commands run the same way: in a `tree.ScratchTree` (a git worktree of
the commit, sharing the project's DVC cache, `dvc` as a subprocess there), their repeated runs pooled by
`spread.pool` and judged by `explain.history.moved`, so that the same runs are "moved" for both or for neither.
"""
