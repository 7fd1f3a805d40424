"""Engine core: requests, KV pages, radix prefix cache, scheduler, and the engine-process loop (loop.py, messages.py: ZMQ). No torch."""
