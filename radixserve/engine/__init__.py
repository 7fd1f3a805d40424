"""Engine core: requests, KV pages, radix prefix cache, scheduler. Pure Python except engine.py."""
