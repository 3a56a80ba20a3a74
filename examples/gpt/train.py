"""Trains the example GPT as one replica of a fault-tolerant job:

    unbroken run --replicas 3 -- python examples/gpt/train.py --steps 200

The script is ``unbroken/examples/gpt/train.py`` (read it there: its unbroken lines are marked),
shipped inside the package so that ``unbroken demo`` and the benchmarks also run from an
installed wheel; this file starts it from a checkout by path, as a torchrun user would.
"""

from unbroken.examples.gpt.train import main

if __name__ == "__main__":
    main()
