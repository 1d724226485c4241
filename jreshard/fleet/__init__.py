"""The fleet layer: what a whole-model weight sync costs, computed without touching a device.

- ``catalog``: every weight tensor of a model (built in, or any Hugging Face ``config.json``);
- ``presets``: the ``Layout`` of every tensor under a framework's parallelism
  (attention heads split by ``jreshard.core.heads``; experts over ep, fsdp and
  expert_tp), and the degrees a model can take (``degrees``); ``nn_presets``: the same
  rules on the parameter tree of a ``jreshard.nn`` model;
- ``scenario``: a model, both sides' degrees and devices, and hardware, from one file;
- ``cost``: the cost model (``hardware``, ``traffic``, ``hierarchical`` delivery and the
  ``baselines``), re-exported as one module; ``layer``: one layer's routed experts
  through it, next to published per-layer figures; ``calibration``: published figures
  beside predictions, and their ratio.

Pure (numpy only); builds on the core (``nn_presets`` also reads the pure model
configuration of ``jreshard.nn.config``).
"""
