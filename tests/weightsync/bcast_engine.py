"""An engine process for the broadcast test: join the group, receive N versions, save each to a file."""

from __future__ import annotations

import asyncio
import sys

import nats
import safetensors.torch

from services.lib.weights.transport import make_receiver
from services.runtime.weights_config import BroadcastConfig


async def main(url: str, run_id: str, out_prefix: str, versions: int) -> None:
    nc = await nats.connect(url)
    receiver = make_receiver(
        BroadcastConfig(world_size=2, backend="gloo", timeout_s=30, bucket_bytes=4096), nc, run_id
    )
    await receiver.start()
    for _ in range(versions):
        version, state = await receiver.receive()
        safetensors.torch.save_file(
            {k: v.clone() for k, v in state.items()}, f"{out_prefix}.v{version}.safetensors"
        )
    await receiver.close()
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
