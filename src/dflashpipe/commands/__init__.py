"""The commands beside `dvc` (cli.py wires them): they read the pipeline's state or run it again, and no stage
imports them, so no dvc.yaml dep names them and editing one reruns nothing.

- `explain`: why each stage would rerun, and what moved in the metrics and why (explain, history, the machine);
- `rerun`: the commands that run the pipeline again in a scratch tree (`explain --verify`, `bisect`);
- `plan`: the run on paper, from the stages' own models and FLOP count;
- `report`: one page for the current state of the pipeline.
"""
