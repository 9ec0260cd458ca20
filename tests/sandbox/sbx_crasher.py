"""Run by test_sandbox_lifecycle: start an instance, make sandboxes with running processes, then wait to be killed.

Prints one JSON line {"instance": ..., "sandboxes": [...], "pid": ...} once everything is up.
"""

from __future__ import annotations

import asyncio
import json
import sys

from proto import sandbox as api
from services.sandbox.bwrap import BwrapBackend
from services.sandbox.config import SandboxConfig


async def main(root: str) -> None:
    backend = BwrapBackend(SandboxConfig(root_dir=root, warm_pool=0), lambda e: None)  # test_sandbox_warm_pool: with
    await backend.start()
    ids = []
    for _ in range(2):
        reply = await backend.create(api.CreateRequest(run_id="crashed"))
        ids.append(reply.sandbox_id)
    await backend.exec(api.ExecRequest(run_id="crashed", sandbox_id=ids[0], command=api.Argv(args=["sleep", "300"]),
                                       detach=True))
    await backend.exec(api.ExecRequest(run_id="crashed", sandbox_id=ids[1], command=api.Shell(script="echo x > f")))
    await backend.snapshot(api.SnapshotRequest(run_id="crashed", sandbox_id=ids[1]))
    await backend.pause(api.PauseRequest(run_id="crashed", sandbox_id=ids[0]))
    print(json.dumps({"instance": backend.instance_id, "sandboxes": ids}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
