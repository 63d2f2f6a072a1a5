"""Importing fxtp is light: torch does not load until a name is used, the passes and dynamo
not until a name that traces or compiles is used; the "fxtp" torch.compile backend is found by
name through the
installed package's entry point, without importing fxtp."""
import subprocess
import sys


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_import_fxtp_loads_neither_dynamo_nor_the_passes():
    assert run("import sys, fxtp\n"
               "print('torch._dynamo' in sys.modules, 'fxtp.pipeline' in sys.modules, "
               "'parallelize' in dir(fxtp))\n"
               "print(fxtp.parallelize.__module__, 'fxtp.pipeline' in sys.modules)\n"
               "try:\n    fxtp.paralelize\nexcept AttributeError as e:\n    print(e)"
               ).splitlines() == ["False False True", "fxtp.pipeline True",
                                  "module 'fxtp' has no attribute 'paralelize'"]


def test_import_fxtp_loads_no_torch_until_a_name_is_used():
    assert run("import sys, fxtp\n"
               "print('torch' in sys.modules, 'torch.distributed.tensor' in sys.modules)\n"
               "from fxtp import Shard, ColwiseParallel\n"
               "print(Shard.__module__, ColwiseParallel.__module__,"
               " 'fxtp.pipeline' in sys.modules)"
               ).splitlines() == ["False False", "torch.distributed.tensor.placement_types "
                                  "fxtp.plans.styles False"]


def test_the_compile_backend_is_found_by_name_without_importing_fxtp():
    assert run("import sys; from torch._dynamo.backends.registry import lookup_backend; "
               "backend = lookup_backend('fxtp'); "
               "print(backend.__module__, 'fxtp.pipeline' in sys.modules)"
               ) == "fxtp.compiling.backend False"


def test_a_submodule_named_like_its_function_does_not_shadow_it():
    """``fxtp.parallelize`` and ``fxtp.explain`` stay the functions after their modules
    are imported (here by ``fxtp.inspection.dump``, which imports both)."""
    assert run("import types, fxtp, fxtp.inspection.dump\n"
               "print([type(getattr(fxtp, n)).__name__ for n in ('parallelize', 'explain')])"
               ) == "['function', 'function']"


def test_the_package_lists_its_api_not_its_helpers():
    """``dir(fxtp)`` and tab completion show the public names (all of ``__all__``), not the
    modules the package uses to load them."""
    names = run("import fxtp; print(' '.join(dir(fxtp)))").split()
    assert not {"importlib", "sys", "types"} & set(names)
    assert set(run("import fxtp; print(' '.join(fxtp.__all__))").split()) <= set(names)


def test_no_module_is_named_like_the_name_it_exports():
    """``fxtp.parallelize`` and ``fxtp.explain`` are always the functions: no submodule of
    that name can replace them as the package's attribute once imported."""
    assert run("import fxtp, fxtp.pipeline, fxtp.inspection.explanation, fxtp.cli\n"
               "print(type(fxtp.parallelize).__name__, type(fxtp.explain).__name__)\n"
               "import pkgutil\n"
               "print(sorted(m.name for m in pkgutil.iter_modules(fxtp.__path__)\n"
               "             if m.name in fxtp.__all__))") == "function function\n[]"
