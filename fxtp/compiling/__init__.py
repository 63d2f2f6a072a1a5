"""Compile integration: the ``"fxtp"`` torch.compile backend, parallelizing what dynamo
captures, and regional compilation (``fxtp.compile``, ``fxtp.compile_blocks``)."""
