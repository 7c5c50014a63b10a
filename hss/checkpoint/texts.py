"""English prose found on any machine with CPython, for measuring a language model offline and reproducibly.

Each source is read from the standard library (nothing is copied into the repository):

- ``"license"``: the history section of Python's ``LICENSE.txt`` (absent where a distribution strips it),
  about 340 SmolLM2 tokens.
- ``"heapq"``: François Pinard's essay on heaps (``heapq.__about__``, unchanged since Python 2.3), about 950
  tokens of prose once its ASCII diagram is dropped.
- ``"python"`` (the default): ``"license"`` then ``"heapq"``, about 1300 tokens.
- ``"zen"``: the Zen of Python (``this.py``, decoded from its ROT13 without importing it, which would print it).

The texts are fixed for a given Python version (the license history gains a line now and then).
"""
from __future__ import annotations

import ast
import codecs
import importlib.util
import sysconfig
from pathlib import Path

from hss.errors import HssError

__all__ = ["SOURCES", "english_text", "prose_paragraphs"]


def prose_paragraphs(text: str) -> str:
    """The paragraphs of ``text`` that read as prose, joined by blank lines.

    A paragraph is dropped when a line of it is indented (diagrams, tables, code, hanging footnotes) or made of
    punctuation only (rules, underlines).
    """
    kept = []
    for paragraph in text.strip().split("\n\n"):
        lines = paragraph.strip("\n").splitlines()
        if lines and all(line[:1].strip() and any(ch.isalnum() for ch in line) for line in lines):
            kept.append("\n".join(lines))
    return "\n\n".join(kept)


def _heapq() -> str:
    import heapq
    return prose_paragraphs(heapq.__about__)


def _license() -> str:
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not path.is_file():
        raise HssError(f"{path}: not found (this Python ships without its LICENSE.txt); use english_text('heapq'), "
                       "which every CPython has")
    history = path.read_text(encoding="utf-8").split("B. TERMS AND CONDITIONS")[0]
    return prose_paragraphs(history)


def _zen() -> str:
    spec = importlib.util.find_spec("this")
    if spec is None or spec.origin is None:
        raise HssError("the standard library's this.py is not found; use english_text('heapq')")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["s"]:
            return codecs.decode(ast.literal_eval(node.value), "rot13")
    raise HssError(f"{spec.origin}: no ROT13 string 's' found; use english_text('heapq')")


def _topics() -> str:
    """The prose of the Python help topics (``pydoc_data.topics``, ~460 KB): long English text that does not repeat."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise HssError("pydoc_data.topics is missing from this Python; use english_text('python')") from None
    return "\n\n".join(p for p in (prose_paragraphs(topics[k]) for k in sorted(topics)) if p)


def _python() -> str:
    return _license() + "\n\n" + _heapq()


SOURCES = {"python": _python, "license": _license, "heapq": _heapq, "zen": _zen, "topics": _topics}


def english_text(name: str = "python") -> str:
    """The English text ``name`` (one of :data:`SOURCES`), read from the running Python's standard library."""
    if name not in SOURCES:
        raise HssError(f"english_text: unknown text {name!r}; choose one of {sorted(SOURCES)}")
    return SOURCES[name]()
