"""English sentences for benchmarks that fine-tune or evaluate a sentence encoder offline, from the Python standard
library alone: docstring prose, the language reference pydoc ships, and everyday template sentences (a style the
other two never show, for out-of-domain checks). Deterministic: the same Python gives the same lists in any process.
"""
from __future__ import annotations

import importlib
import inspect
import itertools
import random
import re
import warnings

# stdlib modules whose docstrings are plain English prose (no GUI toolkits, nothing platform-only)
DOC_MODULES = ("argparse", "base64", "bisect", "calendar", "collections", "configparser", "contextlib", "copy",
               "csv", "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools", "gettext", "glob",
               "gzip", "hashlib", "heapq", "html", "http.client", "imaplib", "inspect", "io", "ipaddress",
               "itertools", "json", "logging", "mailbox", "math", "mimetypes", "numbers", "operator", "os",
               "pathlib", "pickle", "platform", "pprint", "queue", "random", "re", "sched", "secrets", "shelve",
               "shlex", "shutil", "smtplib", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile",
               "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "typing", "unittest",
               "urllib.parse", "uuid", "warnings", "wave", "weakref", "zipfile", "zlib")


# -- sentences -------------------------------------------------------------------------------------------------------
def _sentences(text: str) -> list[str]:
    """The 6-24 word sentences of `text` made of letters, digits and plain punctuation (no code, no markup)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
            if 6 <= len(s.split()) <= 24 and re.fullmatch(r"[A-Za-z][A-Za-z0-9 ,;:'()\-]*\.", s)]


def docstring_sentences() -> list[str]:
    """Prose sentences (6-24 words) from stdlib docstrings, deduplicated, in a fixed order."""
    out, seen = [], set()
    with warnings.catch_warnings():  # deprecated attributes (typing.io) warn when read
        warnings.simplefilter("ignore")
        for name in DOC_MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            # the module's own docstring, then its classes and functions: submodules are left out, since which of
            # them a package holds as attributes depends on what else the process happened to import
            objects = [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
            for obj in [mod] + [o for o in objects if inspect.isclass(o) or inspect.isroutine(o)]:
                for s in _sentences(inspect.getdoc(obj) or ""):
                    if s not in seen:
                        seen.add(s)
                        out.append(s)
    return out


def reference_sentences() -> list[str]:
    """Sentences of the Python language reference that pydoc ships (pydoc_data.topics), in a fixed order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return list(dict.fromkeys(s for key in sorted(topics) for s in _sentences(topics[key])))


def template_sentences(n: int, seed: int = 0) -> list[str]:
    """Everyday sentences, a style the docstrings never show: a held-back check that the fine-tuning did not just
    learn the training domain."""
    subj = ["the cat", "a young engineer", "my neighbour", "the committee", "an old fisherman", "this startup",
            "the orchestra", "a tired student", "the river", "our team"]
    verb = ["quietly watched", "rebuilt", "argued about", "painted", "forgot", "celebrated", "measured",
            "translated", "sold", "explored"]
    obj = ["the broken bridge", "a strange melody", "the quarterly budget", "three green apples",
           "an unfinished novel", "the night sky", "a small wooden boat", "the new algorithm",
           "their grandmother's recipe", "the mountain trail"]
    tail = ["", " before sunrise", " with great care", " for no reason at all", " during the storm",
            " while everyone slept", " in under an hour"]
    combos = list(itertools.product(subj, verb, obj, tail))
    picks = random.Random(seed).sample(combos, n)
    return [f"{s} {v} {o}{t}.".capitalize() for s, v, o, t in picks]


def split_sentences(n_train: int, n_held: int) -> tuple[list[str], list[str]]:
    """(train, held back). Held back: docstring sentences never trained on, then as many template sentences.
    Train: the other docstring sentences and the language reference's, shuffled."""
    docs = docstring_sentences()
    random.Random(0).shuffle(docs)
    held_docs = n_held - n_held // 2
    seen = set(docs[:held_docs])
    pool = docs[held_docs:] + [s for s in reference_sentences() if s not in seen]
    random.Random(1).shuffle(pool)
    if len(pool) < n_train:
        raise RuntimeError(f"only {len(pool)} training sentences found; {n_train} needed")
    return pool[:n_train], docs[:held_docs] + template_sentences(n_held // 2)
