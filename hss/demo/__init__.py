"""The demos: :mod:`~hss.demo.model` (``python -m hss demo``: a real model decoding on the GPU, every kv mode) and
:mod:`~hss.demo.qsa` (``python -m hss demo-qsa``: the QSA indexer's decode step)."""
