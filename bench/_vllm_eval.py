"""Generate an offline evaluation's completions with vLLM: run by ``bench/_offline_eval.py`` under the
interpreter of an environment with vLLM (``services.launcher.environments.vllm_python``: this one,
``$RLBUS_VLLM_PYTHON`` or ``.venv-vllm``), one process per model version.

Reads one JSON request on stdin::

    {"model": "<model dir>", "prompts": [[token ids], ...], "temperature": 0.7, "max_tokens": 512,
     "seed": 0, "dtype": "bfloat16", "kv_cache_gib": 2.0}

and writes one JSON line on stdout: ``{"completions": [[token ids], ...], "load_s": ..., "generate_s": ...}``,
one completion per prompt in the prompts' order, each ending at (and including) EOS or cut at
``max_tokens``. Prompt ``i`` is sampled with seed ``seed + i``, so a version's completions do not depend on
how vLLM batches them. vLLM's own log goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time

GIB = 1 << 30


def main() -> int:
    req = json.loads(sys.stdin.read())
    # vLLM and its worker processes print to stdout: send fd 1 to stderr, keep the real one for the answer
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    # whole prefills only: a prompt whose prefill is split over steps has its sampled token thrown away and
    # its seeded generator rewound, which the CPU build cannot do ("CPU Generator does not use offset"); it
    # took the engine down once a step's budget could not hold every prompt (200 long prompts)
    longest = max(len(ids) for ids in req["prompts"]) + int(req["max_tokens"])
    max_len = int(req["max_model_len"]) if req.get("max_model_len") else longest
    llm = LLM(model=req["model"], tokenizer=req["model"], dtype=req.get("dtype", "bfloat16"), enforce_eager=True,
              seed=int(req.get("seed", 0)), kv_cache_memory_bytes=int(float(req.get("kv_cache_gib", 2.0)) * GIB),
              max_model_len=max_len, enable_chunked_prefill=False, max_num_batched_tokens=max(8192, max_len),
              disable_log_stats=True)
    load_s = time.monotonic() - t0
    prompts = [TokensPrompt(prompt_token_ids=list(map(int, ids))) for ids in req["prompts"]]
    params = [SamplingParams(temperature=float(req["temperature"]), top_p=1.0, max_tokens=int(req["max_tokens"]),
                             seed=int(req.get("seed", 0)) + i) for i in range(len(prompts))]
    t1 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.monotonic() - t1
    completions = [list(out.outputs[0].token_ids) for out in outs]
    answer.write(json.dumps({"completions": completions, "load_s": round(load_s, 2),
                             "generate_s": round(generate_s, 2)}) + "\n")
    answer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
