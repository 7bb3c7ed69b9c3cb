"""The command-line programs, installed as `oases-*` entry points (pyproject.toml)."""
