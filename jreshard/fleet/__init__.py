"""The fleet layer: what a whole-model weight sync costs, computed without touching a device.

- ``catalog``: every weight tensor of a model (built in, or any Hugging Face ``config.json``);
- ``presets``: the ``Layout`` of every tensor under a framework's parallelism
  (attention heads split by ``jreshard.core.heads``), and the degrees a model can take;
- ``scenario``: a model, both sides' degrees and devices, and hardware, from one file;
- ``cost``: the cost model (``hardware``, ``traffic``, ``hierarchical`` delivery and the
  ``baselines``), re-exported as one module.

Pure (numpy only); builds on the core.
"""
