"""The benchmark sentence sources: prose only, deterministic across calls (and imports in between), and a
train / held-back split that never shares a sentence."""
import pytest

from automp.bench import sentences as S


def test_sources_are_prose_and_deterministic():
    docs = S.docstring_sentences()
    import asyncio  # noqa: F401 — imports in between must not change the list (package attributes grow)
    import email.mime.text  # noqa: F401
    assert docs == S.docstring_sentences() and len(docs) > 1000
    ref = S.reference_sentences()
    for s in docs[:200] + ref[:200]:
        assert s.endswith(".") and 6 <= len(s.split()) <= 24 and "`" not in s and ">>>" not in s
    assert S.template_sentences(5, seed=3) == S.template_sentences(5, seed=3) != S.template_sentences(5, seed=4)


def test_split_is_disjoint_and_deterministic():
    train, held = S.split_sentences(200, 40)
    assert len(train) == 200 and len(held) == 40 and not set(train) & set(held)
    assert (train, held) == S.split_sentences(200, 40)
    assert held[-20:] == S.template_sentences(20)  # the other-style half comes last
    with pytest.raises(RuntimeError, match="training sentences"):
        S.split_sentences(10**6, 40)
