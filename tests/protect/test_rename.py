import numpy as np
import onnx

from automp.deploy import runtime
from automp.protect.names import graphs, tensor_names
from automp.protect.rename import rename, strip_metadata


def copy(m: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(m)
    return out


def test_every_tensor_and_node_is_renamed_consistently(exported):
    src = exported("encoder")
    m = copy(src)
    res = rename(m, np.random.default_rng(0))
    onnx.checker.check_model(m, full_check=True)
    io = {"tokens", "hidden"}
    old = set(tensor_names(src.graph)) | {n.name for n in src.graph.node}
    new = set(tensor_names(m.graph)) | {n.name for n in m.graph.node}
    assert old & new == io and res.tensors == len(set(tensor_names(src.graph)) - io)
    assert res.nodes == len(src.graph.node) and res.initializers == len(src.graph.initializer)
    assert len({n.name for n in m.graph.node}) == len(m.graph.node)  # node names stay unique
    feeds = runtime.random_feeds(src, seed=1)
    assert np.array_equal(runtime.run(m, feeds)["hidden"], runtime.run(src, feeds)["hidden"])


def test_exporter_metadata_is_stripped(exported):
    m = exported("cnn")  # the dynamo exporter records class hierarchy, FX node and stack per node
    assert any(len(n.metadata_props) for n in m.graph.node) and m.producer_name
    strip_metadata(m, np.random.default_rng(0))
    for g in graphs(m.graph):
        assert not g.value_info and not g.doc_string
        for n in g.node:
            assert not len(n.metadata_props) and not n.doc_string
    assert not m.producer_name and not m.producer_version and not len(m.metadata_props)
    onnx.checker.check_model(m)
