"""Private torch APIs are used through one module, ``fxtp.kernels.torch_compat``: no other
shipped module imports a private torch name or module, reaches for ``torch._x``, or imports
``torch.testing``."""
import ast
from pathlib import Path

import torch
import torch.distributed as dist

from fxtp.kernels import torch_compat

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "fxtp" / "kernels" / "torch_compat.py"


def private_uses(source: str) -> list[str]:
    """Each private torch import or ``torch._x`` / ``torch.ops._x`` attribute in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            parts = node.module.split(".")
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in parts) or "testing" in parts or \
                    any(n.startswith("_") for n in names):
                found.append(f"from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "torch"
                      and any(p.startswith("_") or p == "testing" for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                not node.attr.startswith("__"):
            chain = node.value
            while isinstance(chain, ast.Attribute):
                chain = chain.value
            head = ast.unparse(node.value)
            if isinstance(chain, ast.Name) and chain.id == "torch" and \
                    head in ("torch", "torch.ops", "torch._C") and node.attr != "_check":
                found.append(f"{head}.{node.attr}")
    return found


def test_the_scan_sees_each_kind_of_private_use():
    source = ("import torch.utils._pytree as pytree\n"
              "from torch._ops import OpOverload\n"
              "from torch.amp.autocast_mode import _enter_autocast\n"
              "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
              "torch._foreach_mul_(xs, 2)\n"
              "c = torch.ops._c10d_functional\n"
              "torch._check(x > 0); torch.ops.aten.mm.default; p._local_tensor\n")
    assert sorted(private_uses(source)) == sorted([
        "import torch.utils._pytree", "from torch._ops import OpOverload",
        "from torch.amp.autocast_mode import _enter_autocast",
        "from torch.testing._internal.distributed.fake_pg import FakeStore",
        "torch._foreach_mul_", "torch.ops._c10d_functional"])


def test_only_the_compat_module_touches_torch_internals():
    shipped = [p for folder in ("fxtp", "passes")
               for p in sorted((ROOT / folder).rglob("*.py")) if p != COMPAT]
    assert len(shipped) > 80
    found = {str(p.relative_to(ROOT)): uses for p in shipped
             if (uses := private_uses(p.read_text()))}
    assert found == {}
    assert private_uses(COMPAT.read_text())  # and the compat module is where they are


def test_every_lazy_name_resolves_on_this_torch():
    for name in torch_compat.__all__:
        assert getattr(torch_compat, name) is not None, name


def test_the_fake_process_group_needs_no_torch_testing():
    torch_compat.init_fake_process_group(8, rank=3)
    try:
        t = torch.ones(2)
        dist.all_reduce(t)  # moves nothing
        assert (dist.get_world_size(), dist.get_rank(), t.tolist()) == (8, 3, [1.0, 1.0])
    finally:
        dist.destroy_process_group()


class _Scale(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, k):
        return x * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.k = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.k, None


def test_function_apply_is_autograds_apply_without_binding_arguments(monkeypatch):
    x = torch.randn(3, requires_grad=True)
    want = _Scale.apply(x, 2.0)
    want.sum().backward()
    want_grad, x.grad = x.grad, None

    def no_binding(*args, **kwargs):
        raise AssertionError("inspect.signature called")
    monkeypatch.setattr("inspect.signature", no_binding)
    got = torch_compat.function_apply(_Scale, x, 2.0)
    got.sum().backward()
    assert type(got.grad_fn) is type(want.grad_fn)
    assert torch.equal(got, want) and torch.equal(x.grad, want_grad)


def test_function_apply_binds_under_functorch_transforms():
    x = torch.randn(4, 3)
    got = torch.func.vmap(lambda row: torch_compat.function_apply(_Scale, row, 3.0))(x)
    assert torch.equal(got, x * 3.0)
