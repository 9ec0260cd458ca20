"""Runs mini-swe-agent, unchanged, as an rlbus command agent: its stock ``DefaultAgent`` and
``LocalEnvironment`` built from its own default config (``minisweagent/config/default.yaml``), its
``LitellmModel`` through litellm's OpenAI provider against the episode's session on the rollout's endpoint.

rlbus runs this file in the episode's sandbox (task ``swe_fix``, services/tasks/swe_fix.py) with
``OPENAI_BASE_URL``/``OPENAI_API_KEY`` (the session), ``RLBUS_MODEL`` (the served model's name),
``RLBUS_PROMPT_FILE`` (the problem statement) and the settings below in the environment; the working
directory is the repository to fix. Only these values of the stock config are set here:

* ``model_name = "openai/<served>"`` with ``api_base``/``api_key`` from the environment, ``max_tokens`` and
  ``temperature`` per call (``RLBUS_MAX_TOKENS``, ``RLBUS_TEMPERATURE``), and cost tracking off (the served
  model has no price: ``MSWEA_COST_TRACKING=ignore_errors``, set by the task);
* ``step_limit`` = ``RLBUS_STEP_LIMIT`` (the session refuses calls past its budget anyway);
* ``max_consecutive_format_errors = 1``: after a reply without a tool call the stock agent drops that reply
  from its history and asks again, which rewrites the conversation; rlbus trains an episode as one sequence
  and refuses one whose history was rewritten, so the agent stops at its first format error instead.

Prints one JSON line: the agent's exit status and its model calls.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import builtin_config_dir
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel


def main() -> int:
    config = yaml.safe_load((builtin_config_dir / "default.yaml").read_text(encoding="utf-8"))
    model_config = config.get("model", {})
    model_kwargs = {**model_config.get("model_kwargs", {}), "api_base": os.environ["OPENAI_BASE_URL"],
                    "api_key": os.environ["OPENAI_API_KEY"],
                    "max_tokens": int(os.environ.get("RLBUS_MAX_TOKENS", "256")),
                    "temperature": float(os.environ.get("RLBUS_TEMPERATURE", "1.0"))}
    model = LitellmModel(**{**model_config, "model_name": f"openai/{os.environ['RLBUS_MODEL']}",
                            "model_kwargs": model_kwargs, "cost_tracking": "ignore_errors"})
    env = LocalEnvironment(**{**config.get("environment", {}), "cwd": os.getcwd()})
    agent_config = {**config.get("agent", {}), "step_limit": int(os.environ.get("RLBUS_STEP_LIMIT", "0")),
                    "max_consecutive_format_errors": 1}
    agent = DefaultAgent(model, env, **agent_config)
    task = Path(os.environ["RLBUS_PROMPT_FILE"]).read_text(encoding="utf-8")
    result = agent.run(task=task)
    print(json.dumps({"exit_status": result.get("exit_status", ""), "calls": agent.n_calls}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
