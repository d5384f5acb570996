"""The ``"vescale"`` torch.compile backend (``backend``), the compiled graph variants it runs, binding a
graph to its buckets (``rebind``), ``explain``, and the passes in data order (``passes/``)."""
