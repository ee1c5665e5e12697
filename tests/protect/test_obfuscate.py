"""End to end: protected models compute what the originals compute, and show none of their names or weights."""
import json

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from automp.deploy import runtime
from automp.protect import ObfuscateConfig, obfuscate
from automp.protect.names import graphs, tensor_names
from automp.quant.ptq.compare import compare

from ..deploy.util import f32, init, model, rand

MODELS = ["cnn", "encoder", "encoder_dynamo", "convnet_bn"]


def rel_errors(before: onnx.ModelProto, after: onnx.ModelProto, seed: int = 7, io_map=None) -> dict[str, float]:
    """||out - ref|| / ||ref|| per output on fresh seeded inputs (batch 3, another batch size than verify's)."""
    io_map = io_map or {}
    feeds = runtime.random_feeds(before, batch=3, seed=seed)
    ref = runtime.run(before, feeds, optimize=False)
    got = runtime.run(after, {io_map.get(k, k): v for k, v in feeds.items()}, optimize=False)
    assert all(np.abs(v).max() > 0 for v in ref.values())  # not a test on zeros
    return {k: compare(got[io_map.get(k, k)], r).rel_l2 for k, r in ref.items()}


def names(m: onnx.ModelProto) -> set[str]:
    return set(tensor_names(m.graph)) | {n.name for g in graphs(m.graph) for n in g.node if n.name}


def float_inits(m: onnx.ModelProto) -> list[np.ndarray]:
    return [numpy_helper.to_array(t) for g in graphs(m.graph) for t in g.initializer
            if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)]


@pytest.mark.parametrize("name", MODELS)
def test_protected_model_computes_the_same_outputs(exported, name):
    src = exported(name)
    out, rep = obfuscate(src, ObfuscateConfig(seed=1, ratio=0.5))
    onnx.checker.check_model(out, full_check=True)
    errs = rel_errors(src, out)
    assert max(errs.values()) <= 1e-5, errs
    assert max(rep.error_vs_original["rel_l2"].values()) <= 1e-5
    assert rep.scaled["layers"] >= 3 and rep.inserted["branches"] > 0 and rep.inserted["identity_spots"] > 0


@pytest.mark.parametrize("name", MODELS)
def test_no_original_name_survives_but_the_io_names(exported, name):
    src = exported(name)
    out, rep = obfuscate(src, ObfuscateConfig(seed=2, ratio=0.3))
    io = {v.name for v in list(src.graph.input) + list(src.graph.output)}
    assert names(out) & names(src) == io
    assert sorted(rep.renamed["io_kept"]) == sorted(io) and rep.renamed["io_renamed"] == {}
    for node in out.graph.node:
        assert not node.doc_string and not len(node.metadata_props)
    assert not out.graph.value_info and not out.producer_name


def test_rename_io_renames_inputs_and_outputs_too(exported):
    src = exported("cnn")
    out, rep = obfuscate(src, ObfuscateConfig(seed=3, ratio=0.3, rename_io=True))
    assert not names(out) & names(src)
    io_map = rep.renamed["io_renamed"]
    assert set(io_map) == {"image", "logits"} and rep.renamed["io_kept"] == []
    assert [i.name for i in out.graph.input] == [io_map["image"]]
    assert max(rel_errors(src, out, io_map=io_map).values()) <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_no_initializer_equals_an_original_weight(exported, name):
    """Every original float weight (size >= 2: weights, biases, norms, BN statistics) is absent from the protected
    model, exactly and at 1e-6; scalars are split too (reported), though a small random constant may equal 0.5."""
    src = exported(name)
    out, rep = obfuscate(src, ObfuscateConfig(seed=4, ratio=0.5))
    new = float_inits(out)
    originals = [w for w in float_inits(src) if w.size >= 2]
    assert originals
    for w in originals:
        for v in new:
            if v.shape == w.shape:
                assert not np.array_equal(v, w) and not np.allclose(v, w, rtol=1e-6, atol=1e-6)
    assert rep.scaled["weights"] + rep.split["split"] >= len(originals)


@pytest.mark.parametrize("name", ["cnn", "encoder"])
def test_op_histogram_node_count_and_order_change(exported, name):
    src = exported(name)
    out, rep = obfuscate(src, ObfuscateConfig(seed=5, ratio=0.4))
    assert rep.ops_after != rep.ops_before and rep.nodes["after"] != rep.nodes["before"]
    assert rep.nodes["after"] == len(out.graph.node) and rep.nodes["before"] == len(src.graph.node)
    assert rep.ops_after.get("If", 0) == rep.inserted["branches"]
    # the same run without the shuffle has the same nodes (names are drawn before the order) in another order
    kept, _ = obfuscate(src, ObfuscateConfig(seed=5, ratio=0.4, shuffle=False))
    serialized = [[n.SerializeToString() for n in m.graph.node] for m in (out, kept)]
    assert sorted(serialized[0]) == sorted(serialized[1]) and serialized[0] != serialized[1]
    assert rep.shuffled["order_changed"] and rep.shuffled["moved"] > 0.25


@pytest.mark.parametrize("name", ["cnn", "encoder"])
def test_ratio_zero_inserts_nothing_and_one_inserts_everywhere(exported, name):
    src = exported(name)
    none, r0 = obfuscate(src, ObfuscateConfig(seed=6, ratio=0.0))
    assert r0.inserted["branches"] == r0.inserted["identity_spots"] == r0.inserted["identity_ops"] == 0
    assert r0.inserted["predicate_nodes"] == 0 and "If" not in r0.ops_after and r0.nodes["in_branches"] == 0
    assert r0.inserted["branch_eligible"] > 0 and r0.inserted["identity_eligible"] > 0
    full, r1 = obfuscate(src, ObfuscateConfig(seed=6, ratio=1.0))
    assert r1.inserted["branches"] == r1.inserted["branch_eligible"] == r0.inserted["branch_eligible"]
    assert r1.inserted["identity_spots"] == r1.inserted["identity_eligible"] == r0.inserted["identity_eligible"]
    # each eligible node was replaced by one If, so the main graph grew by the identity ops and predicates only
    assert sum(n.op_type == "If" for n in full.graph.node) == r1.inserted["branches"]
    assert len(full.graph.node) - len(none.graph.node) == r1.inserted["identity_ops"] + r1.inserted["predicate_nodes"]
    assert max(rel_errors(src, full).values()) <= 1e-5


def test_same_seed_gives_the_same_model_and_another_seed_does_not(exported):
    src = exported("encoder")
    a, ra = obfuscate(src, ObfuscateConfig(seed=11, ratio=0.3))
    b, _ = obfuscate(src, ObfuscateConfig(seed=11, ratio=0.3))
    c, _ = obfuscate(src, ObfuscateConfig(seed=12, ratio=0.3))
    assert a.SerializeToString() == b.SerializeToString() != c.SerializeToString()
    assert ra.deterministic and not obfuscate(src, ObfuscateConfig(ratio=0.0))[1].deterministic


def test_the_input_model_is_not_modified(exported):
    src = exported("convnet_bn")
    before = src.SerializeToString()
    obfuscate(src, ObfuscateConfig(seed=0, ratio=1.0))
    assert src.SerializeToString() == before


def test_report_is_json_and_says_what_still_shows(exported, tmp_path):
    src = exported("cnn")
    _, rep = obfuscate(src, ObfuscateConfig(seed=0, ratio=0.2))
    data = json.loads(rep.to_json())
    vis = data["still_visible"]
    assert [i["name"] for i in vis["inputs"]] == ["image"] and [o["name"] for o in vis["outputs"]] == ["logits"]
    assert vis["inputs"][0]["shape"][1:] == [3, 16, 16]
    assert vis["layer_count"] == 3 and vis["weight_layers"] == {"Conv": 2, "Gemm": 1}
    assert any("constant folding" in n for n in vis["notes"])
    rep.write(tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["scaled"] == data["scaled"]


def test_bn_scale_is_absorbed_and_the_last_layer_needs_one_mul(exported):
    """conv -> BN -> ReLU -> pool -> flatten -> MatMul: conv's scale goes into BN's statistics, BN's own scale into
    the MatMul's rows; only the MatMul feeding the graph output needs a compensating Mul."""
    _, rep = obfuscate(exported("convnet_bn"), ObfuscateConfig(seed=0, ratio=0.0))
    assert rep.scaled["by_op"] == {"Conv": 1, "BatchNormalization": 1, "MatMul": 1}
    assert rep.scaled["absorbed"] == 2 and rep.scaled["compensation_muls"] == 1


def test_custom_domain_ops_are_renamed_but_not_touched(exported):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("BiasGelu", ["h", "b"], ["g"], domain="com.microsoft", name="bias_gelu"),
             helper.make_node("MatMul", ["g", "w2"], ["y"], name="mm2")]
    src = model(nodes, [f32("x", ["n", 4])], [f32("y", ["n", 3])],
                [init("w", rand(4, 6)), init("b", rand(6, seed=2)), init("w2", rand(6, 3, seed=3))], ms=True)
    out, rep = obfuscate(src, ObfuscateConfig(seed=0, ratio=1.0))
    assert max(rel_errors(src, out).values()) <= 1e-5
    gelu = [n for n in out.graph.node if n.op_type == "BiasGelu"]
    assert len(gelu) == 1 and gelu[0].domain == "com.microsoft" and gelu[0].name != "bias_gelu"
    bias = next(t for t in out.graph.initializer if t.name == gelu[0].input[1])
    np.testing.assert_array_equal(numpy_helper.to_array(bias), rand(6, seed=2))  # read as is: not ours to change
    assert rep.split["skipped"]["read by a custom-domain op"] == 1
    assert any("com.microsoft:BiasGelu" in n for n in rep.notes)


def test_a_model_with_its_own_branches_keeps_them_working():
    """An If already in the model: its bodies read outer tensors (the shuffle must keep their producers first and
    the rename must rename inside the bodies); it is not wrapped again and the scale stops at it."""
    then_g = helper.make_graph([helper.make_node("Relu", ["h"], ["t_out"])], "then", [], [f32("t_out", ["n", 6])])
    else_g = helper.make_graph([helper.make_node("Neg", ["h"], ["e_out"])], "else", [], [f32("e_out", ["n", 6])])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0, name="sum"),
             helper.make_node("Greater", ["s", "zero"], ["c"], name="gt"),
             helper.make_node("If", ["c"], ["branch"], then_branch=then_g, else_branch=else_g, name="if"),
             helper.make_node("MatMul", ["branch", "w2"], ["y"], name="mm2")]
    src = model(nodes, [f32("x", ["n", 4])], [f32("y", ["n", 3])],
                [init("w", rand(4, 6)), init("zero", np.float32(0)), init("w2", rand(6, 3, seed=3))])
    out, rep = obfuscate(src, ObfuscateConfig(seed=0, ratio=1.0))
    onnx.checker.check_model(out, full_check=True)
    assert names(out) & names(src) == {"x", "y"}
    for seed in (7, 8, 9):  # both branch outcomes of the model's own If (sum(x) > 0 or not)
        assert max(rel_errors(src, out, seed=seed).values()) <= 1e-5
    assert rep.inserted["branches"] == rep.inserted["branch_eligible"]


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_ratio_outside_zero_one_is_refused(ratio):
    with pytest.raises(ValueError, match="ratio"):
        ObfuscateConfig(ratio=ratio)


def test_bad_config_values_are_refused():
    for kwargs, needle in [({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"), ({"max_scale": 1.2}, "max_scale"),
                           ({"tolerance": 0}, "tolerance"), ({"key": "abcd"}, "key")]:
        with pytest.raises(ValueError, match=needle):
            ObfuscateConfig(**kwargs)
    with pytest.raises(TypeError, match="ObfuscateConfig"):
        obfuscate(model([helper.make_node("Relu", ["x"], ["y"])], [f32("x", [2])], [f32("y", [2])]), {"ratio": 1})


def test_corrupt_missing_and_non_onnx_files_are_refused(tmp_path, exported):
    data = exported("convnet_bn").SerializeToString()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.onnx: not a readable ONNX file"):
        obfuscate(cut)
    text = tmp_path / "notes.txt"
    text.write_text("this is not a model\n" * 20)
    with pytest.raises(ValueError, match="notes.txt"):
        obfuscate(text)
    with pytest.raises(FileNotFoundError, match="nope.onnx"):
        obfuscate(tmp_path / "nope.onnx")
    with pytest.raises(ValueError, match="<bytes>"):
        obfuscate(np.random.default_rng(0).bytes(300))
    with pytest.raises(TypeError, match="list"):
        obfuscate([1, 2])


def test_unsupported_model_features_name_the_problem(exported, tmp_path):
    old = model([helper.make_node("Relu", ["x"], ["y"])], [f32("x", [2, 3])], [f32("y", [2, 3])], opset=10)
    with pytest.raises(ValueError, match="opset >= 11.*opset 10"):
        obfuscate(old, ObfuscateConfig(seed=0, ratio=0.5))
    assert obfuscate(old, ObfuscateConfig(seed=0, ratio=0.0))[1].renamed["nodes"] == 1  # other transforms work

    onnx.save(exported("convnet_bn"), tmp_path / "ext.onnx", save_as_external_data=True, location="ext.data",
              size_threshold=0)
    external = onnx.load(tmp_path / "ext.onnx", load_external_data=False)
    with pytest.raises(ValueError, match="external data that was not loaded"):
        obfuscate(external)
    assert obfuscate(tmp_path / "ext.onnx", ObfuscateConfig(seed=0, ratio=0.2))[1].scaled["layers"] == 3  # by path
    with_training = exported("convnet_bn")
    with_training.training_info.add()
    with pytest.raises(ValueError, match="training_info"):
        obfuscate(with_training)
