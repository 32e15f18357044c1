"""Is the draft's weakness on MT-Bench the prompts or the answer's start? The shipped draft's top-1 accuracy by depth
(the trainer's held-out evaluation) on SmolLM2's own greedy answers, 128 new tokens, to (a) MT-Bench first turns and
(b) ShareGPT first turns from the end of shard 03, float32 on the CPU. The exact generated tokens are evaluated (no
re-tokenisation).
    PYTHONPATH=. python3 tools/diag/acc_by_source.py [N]     (run from the repository root; N prompts per source)"""
import json
import sys

import numpy as np
import torch

from eyas import LLM, SamplingParams
from eyas.train.data import Example, normalize_messages, read_jsonl
from eyas.train.trainer import TrainConfig, evaluate

N = int(sys.argv[1]) if len(sys.argv) > 1 else 40
torch.manual_seed(0)
mt = [[{"role": "user", "content": json.loads(l)["turns"][0]}]
      for l in open("../shared/data/mt_bench/question.jsonl") if l.strip()][:N]
sg = []
for rec in read_jsonl("../shared/data/sharegpt/sharegpt-train-03.jsonl.gz"):
    m = normalize_messages(rec)
    if m and len(m[0]["content"]) < 2000:
        sg.append(m[:1])
sg = sg[-N:]
llm = LLM("smollm2", device="cpu", dtype="float32", draft="default", speculation="chain:3")
cfg = TrainConfig(tpc_prompts=0, amp=False)
for name, convs in [("mt_bench", mt), ("sharegpt_03_tail", sg)]:
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=128))
    exs = [Example(np.asarray(o.prompt_token_ids + o.token_ids, dtype=np.int32),
                   np.asarray([False] * len(o.prompt_token_ids) + [True] * len(o.token_ids)))
           for o in outs]
    r = evaluate(llm.target, [llm.draft], exs, cfg, torch.device("cpu"))[0]
    tpc = sum(o.stats.committed for o in outs) / sum(o.stats.target_calls for o in outs)
    print(json.dumps({"source": name, "prompts": len(exs), "acc_by_depth": [round(a, 3) for a in r["acc_by_depth"]],
                      "positions": r["positions"], "tpc_chain3": round(tpc, 3)}), flush=True)
