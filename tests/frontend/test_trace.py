"""The trace keeps what the passes read and nothing they do not: every op carries its module
stack, none the user source lines that made it, whose recording is a fifth of export's time."""
import pytest
import torch
import torch.fx

import fxtp
from tests.helpers import transformer_models as tm

TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.skipif(not hasattr(torch.fx.config, "do_not_emit_stack_traces"),
                    reason="this torch always records source lines")
def test_traced_ops_carry_their_modules_but_no_source_lines(fake_group):
    fake_group(2)
    gm = fxtp.parallelize(tm.Llama(tm.LlamaConfig(n_layers=2)), tm.llama_plan(),
                          example_inputs=(TOKENS,))
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert any("nn_module_stack" in n.meta for n in ops)
    assert not any(n.meta.get("stack_trace") for n in ops)
    assert torch.fx.config.do_not_emit_stack_traces is False  # the user's setting is back
