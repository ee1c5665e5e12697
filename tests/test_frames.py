"""automp.frames: a function with a code object of its own computes what the original does, and is compiled apart."""
import torch

from automp.frames import own_code


def test_own_code_keeps_behaviour_and_takes_a_new_code_object():
    scale = 3.0

    def f(x, k=2):
        return x * k * scale
    a, b = own_code(f, "first"), own_code(f, "second")
    assert a.__code__ is not f.__code__ and a.__code__ is not b.__code__
    assert (a.__name__, a.__code__.co_name) == ("first", "first")
    x = torch.randn(5)
    assert torch.equal(a(x), f(x)) and torch.equal(b(x, k=4), f(x, k=4))


def test_two_compiled_copies_keep_their_own_graphs():
    """Dynamo's cache is per code object: each copy compiles once, and neither evicts or recompiles the other."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x):
        return torch.sin(x) + 1
    torch._dynamo.reset()
    a, b = (torch.compile(own_code(f, n), backend=backend) for n in ("a", "b"))
    x = torch.randn(4)
    for _ in range(2):
        assert torch.allclose(a(x), f(x)) and torch.allclose(b(x), f(x))
    assert len(graphs) == 2
    torch._dynamo.reset()
