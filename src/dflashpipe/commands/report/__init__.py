"""`dflashpipe report`: one page for the current state of the pipeline.

One job per module, imported by its full name (this file re-exports nothing):
- `build`: reads the pipeline's state (explain HEAD vs the workspace, the metrics, the plots) into a `RunReport`
  and writes the page;
- `page`: lays a `RunReport` out, as one self-contained HTML file or as Markdown with an images folder;
- `contents`: the `RunReport` itself, what the page holds; below both, so neither imports the other back.
"""
