"""Float32 :class:`~hss.checkpoint.model.Weights` from a file's named tensors: every name present, every shape the
config's, nothing unexplained left over, all checked before any tensor data is read."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from hss.checkpoint.model import Config, LayerWeights, Weights
from hss.errors import HssError

__all__ = ["TensorNames", "assemble", "describe"]


@dataclass(frozen=True)
class TensorNames:
    """A format's tensor names: ``layer`` maps each :class:`LayerWeights` field to a pattern with ``{i}``."""

    embed: str
    final_norm: str
    lm_head: str
    layer: Mapping[str, str]
    ignored: Callable[[str], bool] = lambda name: False


def describe(c: Config) -> str:
    return (f"{c.n_layer} layers, dim {c.dim}, {c.n_head} heads and {c.n_kv_head} kv heads of {c.head_dim}, ffn "
            f"{c.ffn_dim}, vocabulary {c.vocab_size}")


def _expected(config: Config, names: TensorNames, head: bool) -> Iterator[tuple[str, tuple[int, ...], str, int]]:
    """(file name, shape, field, layer or -1) of every tensor ``config`` needs."""
    c = config
    yield names.embed, (c.vocab_size, c.dim), "embed", -1
    yield names.final_norm, (c.dim,), "final_norm", -1
    if head:
        yield names.lm_head, (c.vocab_size, c.dim), "lm_head", -1
    shapes = LayerWeights.shapes(c)
    for i in range(c.n_layer):
        for field, pattern in names.layer.items():
            yield pattern.format(i=i), shapes[field], field, i


def assemble(config: Config, shapes: Mapping[str, tuple[int, ...]], read: Callable[[str], np.ndarray],
             names: TensorNames, head: bool,
             fix: Callable[[str, np.ndarray], np.ndarray] | None = None) -> Weights:
    """The weights of ``config`` from tensors named as ``names`` says: ``shapes`` (name → shape) is checked first,
    then ``read(name)`` gives each one as float32; ``fix(field, array)`` adjusts a field's array (e.g. un-permutes
    rows). ``head``: the file has its own output matrix (else it is tied to the embedding and ``names.lm_head``, if
    present, is ignored)."""
    needed = 2 + head + config.n_layer * len(names.layer)
    if needed > len(shapes):   # the first missing one is among the first len(shapes) + 1 names
        first = next(name for name, *_ in _expected(config, names, head) if name not in shapes)
        raise HssError(f"missing tensor {first!r}: the config ({describe(config)}) needs {needed} tensors, the file "
                       f"has {len(shapes)}")
    want = {name: (shape, field, i) for name, shape, field, i in _expected(config, names, head)}
    missing = [name for name in want if name not in shapes]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise HssError(f"missing tensor {', '.join(map(repr, missing[:3]))}{more} (the config: {describe(config)})")
    for name, (shape, _, _) in want.items():
        if tuple(shapes[name]) != shape:
            raise HssError(f"tensor {name!r} has shape {tuple(shapes[name])}, the config ({describe(config)}) needs "
                           f"{shape}")
    extra = [name for name in shapes if name not in want and not names.ignored(name)
             and not (name == names.lm_head and not head)]
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise HssError(f"unexpected tensor {', '.join(map(repr, extra[:3]))}{more}: the Llama forward has no use "
                       f"for it (another architecture, more layers than the config says, or a feature hss does not "
                       f"implement)")
    fix = fix or (lambda field, a: a)
    layers: list[dict[str, np.ndarray]] = [{} for _ in range(config.n_layer)]
    top: dict[str, np.ndarray] = {}
    for name, (_, field, i) in want.items():
        array = fix(field, read(name))
        (top if i < 0 else layers[i])[field] = array
    return Weights(config=config, embed=top["embed"], layers=tuple(LayerWeights(**fields) for fields in layers),
                   final_norm=top["final_norm"], lm_head=top.get("lm_head"))
