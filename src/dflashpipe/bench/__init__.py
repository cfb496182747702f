"""The bench stage (stage.py): the drafter's training step alone, on synthetic inputs."""
