"""The front end: a single-device model in, an ATen-level ``fx.GraphModule`` out, that keeps
the model's module names, hooks, custom autograd functions and mode regions; each distinct
block traced once (stamping)."""
