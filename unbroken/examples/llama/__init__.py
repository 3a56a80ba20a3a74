"""A ``transformers`` Llama trained with FSDP2 inside each replica (the torchtitan HSDP shape).

Needs the ``examples`` extra (``pip install 'unbroken[examples]'``, which pins ``transformers``).
:mod:`~unbroken.examples.llama.llama_model` builds the model from a small config,
:mod:`~unbroken.examples.llama.markov_tokens` generates its token data,
:mod:`~unbroken.examples.llama.train` is the training loop (``examples/llama/train.py`` is its
command line).
"""
