import torch

from automp.precision import lists
from automp.precision.lists import Category

aten = torch.ops.aten


def test_core_ops_are_on_the_expected_lists():
    assert lists.classify(aten.mm.default) is Category.ALLOW
    assert lists.classify(aten.convolution.default) is Category.ALLOW
    assert lists.classify(aten._softmax.default) is Category.DENY
    assert lists.classify(aten._log_softmax.default) is Category.DENY
    assert lists.classify(aten.native_layer_norm.default) is Category.DENY
    assert lists.classify(aten.sum.dim_IntList) is Category.DENY
    assert lists.classify(aten.exp.default) is Category.DENY
    assert lists.classify(aten.add.Tensor) is Category.INFER
    assert lists.classify(aten.view.default) is Category.CLEAR
    assert lists.classify(aten.max_pool2d_with_indices.default) is Category.CLEAR
    assert lists.classify(aten.embedding.default) is Category.GATHER


def test_unknown_op_is_unknown_and_reason_names_it():
    assert lists.classify_name("frobnicate") is Category.UNKNOWN
    assert "frobnicate" in lists.reason("frobnicate")


def test_every_listed_op_has_a_one_line_reason():
    for cat in Category:
        for name in lists.names(cat):
            why = lists._WHY[name][1]
            assert why and "\n" not in why, name


def test_in_place_variant_classified_like_its_op():
    assert lists.classify_name("mul_") is Category.INFER
