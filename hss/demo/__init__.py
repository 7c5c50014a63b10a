"""The demos: :mod:`~hss.demo.model` (``python -m hss demo``: a real model decoding on the GPU, every kv mode), its
batched path :mod:`~hss.demo.batch` (``python -m hss demo --batch N``: N prompts through BatchSession) and
:mod:`~hss.demo.qsa` (``python -m hss demo-qsa``: the QSA indexer's decode step)."""
