"""A rollout worker process for the tests: registers the black-box test agents (``black_box_agents``), then
runs ``rlbus service`` with this script's arguments (e.g. ``rollout --config run.toml --instance rollout-a``)."""

from __future__ import annotations

import sys

import black_box_agents  # noqa: F401  (registers the test agents' tasks in this process)

from services.launcher.cli import main

if __name__ == "__main__":
    sys.exit(main(["service", *sys.argv[1:]]))
