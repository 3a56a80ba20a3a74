"""A small GPT, its generated data and its fault-tolerant training script (``train.py``).

Run as ``unbroken run --replicas 3 -- python -m unbroken.examples.gpt.train``; the demo, the
recovery, checkpoint and diagnosis benchmarks and the integration tests train it.
"""
