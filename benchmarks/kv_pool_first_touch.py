"""16 prompts of 200-400 random tokens, 32 greedy tokens each, twice (new prompts, so new KV pages both times) through
radixserve.LLM on the default model: seconds per pass. Run it from two checkouts (PYTHONPATH=...) to compare KV pool
allocations; the first pass writes pages no request touched before.

    PYTHONPATH=. python benchmarks/kv_pool_first_touch.py
"""
import random, time, json, os
from radixserve import LLM, SamplingParams
llm = LLM(None)
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(200, 400))] for _ in range(16)]
p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
out = {}
for name in ("first_pass", "second_pass"):
    t = time.perf_counter()
    llm.generate(prompts, p, use_tqdm=False)
    out[name] = round(time.perf_counter() - t, 3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(200, 400))] for _ in range(16)]
out["load"] = os.getloadavg()[0]
print(json.dumps(out))
