"""The worker's staging tensors after a commit: reused where the model let go of them, renewed where it kept them."""

from __future__ import annotations

import gc

import torch

from bridge import BridgePlan, Source, trainer_mesh
from bridge.engines.hello import EngineShape, build_param_map
from bridge.engines.worker import StagingReceiver, _shared, _staging
from bridge.recipes import Recipe
from bridge.wire import shm
from jreshard.nn import LlamaConfig, fsdp_spec, param_shapes


def test_shared_sees_every_other_holder_of_the_storage():
    t = torch.zeros(4, 3)
    assert not _shared(t)
    view = t[1:]
    assert _shared(t)
    del view
    assert not _shared(t)
    layer = torch.nn.Linear(3, 4, bias=False)
    layer.weight.data = t  # what an engine's commit (vLLM's write_layers) does with an adopted tensor
    assert _shared(t)
    layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # vLLM's CPU packing empties it
    assert not _shared(t)
    kept = t.detach()  # a kernel that saved the weight (a closure, a C++ op holding the tensor)
    assert _shared(t)
    del kept


def test_renew_replaces_only_the_tensors_the_model_still_holds():
    cfg = LlamaConfig.load("llama-tiny", num_hidden_layers=1)
    src = Source.build(param_shapes(cfg), trainer_mesh((2,), "fsdp", [0], 2), fsdp_spec)
    param_map = build_param_map(src, Recipe.llama(cfg), EngineShape(((1,),), False, "float32"))
    receiver = StagingReceiver(BridgePlan(src, param_map), {p.name: torch.zeros(p.shape) for p in
                                                             param_map.for_rank(1)}, rank=1, atomic=False)
    kept, dropped = "model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight"
    before = {n: receiver.params[n] for n in (kept, dropped)}
    holder = torch.nn.Parameter(before[kept], requires_grad=False)  # the embedding layer keeps its weight
    assert receiver.renew([kept, dropped]) == [kept]
    assert receiver.params[kept] is not before[kept] and receiver.params[kept].shape == before[kept].shape
    assert receiver.params[dropped] is before[dropped]  # reused by the next sync: no fresh pages
    assert holder.data_ptr() == before[kept].data_ptr()  # the model's weights are never written by a sync


def test_staging_stays_in_shared_memory_across_commits():
    # The receiver keeps each tensor's .data; the staging must stay in its segment after the tensors
    # _staging made are gone, or same-host trainers' bytes fall back to gloo (they did from the
    # garbage collector's first pass on, a few syncs in).
    cfg = LlamaConfig.load("llama-tiny", num_hidden_layers=1)
    src = Source.build(param_shapes(cfg), trainer_mesh((2,), "fsdp", [0], 2), fsdp_spec)
    param_map = build_param_map(src, Recipe.llama(cfg), EngineShape(((1,),), False, "float32"))
    mine = param_map.for_rank(1)
    receiver = StagingReceiver(BridgePlan(src, param_map), _staging({p.name: (p.shape, torch.float32) for p in mine},
                                                                    "cpu"), rank=1, atomic=False)
    kept = "model.embed_tokens.weight"
    holder = torch.nn.Parameter(receiver.params[kept], requires_grad=False)
    for _ in range(3):  # commits that adopt every tensor: the model holds one, lets go of the others
        assert receiver.renew([p.name for p in mine]) == [kept]
        holder.data = receiver.params[kept]
        gc.collect()
        assert [p.name for p in mine if shm.find(receiver.params[p.name]) is None] == []
